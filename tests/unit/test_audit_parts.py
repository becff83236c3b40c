"""The audit's parts: the head walked in vocabulary blocks gives what one full matmul gives, the
alignment verdict, where the LM head is found (tied embeddings too), the device, and the report
as JSON, markdown and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hsx.audit.agreement import alignment_verdict
from hsx.audit.head import HeadSource, OutputHead, choose_device, find_head
from hsx.engine.homes import engine_queue_limit
from hsx.errors import ConfigError
from hsx.extraction.host_pipeline import HostPipeline
from hsx.model.families import logit_softcap
from hsx.trainers.final_norm import FinalNorm
from settings import PipelineSettings
from tests.audit_models import model_config, write_model, write_store

pytestmark = pytest.mark.timeout(120)


def _head(vocab: int = 50, hidden: int = 16) -> OutputHead:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(vocab, hidden, generator=generator)  # [V, H]
    norm = FinalNorm(0.5 + torch.rand(hidden, generator=generator), 1e-6, "test:norm")
    source = HeadSource("test:head", False, norm.source, vocab, "cpu", "float32")
    return OutputHead(norm, weight, source)


def test_the_head_in_vocabulary_blocks_gives_the_full_matmul() -> None:
    head = _head()
    states = torch.randn(9, 16, generator=torch.Generator().manual_seed(1)) * 30  # [n, H]
    targets = torch.tensor([[3, 7, 49]] * 8 + [[-1, 0, 12]])  # [n, 3]; -1: no target
    logits = head.norm(states) @ head.weight.T  # [n, V]: the reference
    head.block_rows = 7  # 8 blocks, the last one short
    scores = head.score(states, targets)
    assert torch.equal(scores.top, logits.topk(5, dim=1).indices)
    assert torch.allclose(scores.top_logit, logits.max(dim=1).values)
    assert torch.allclose(scores.log_norm, torch.logsumexp(logits, dim=1), atol=1e-5)
    expected = logits.gather(1, targets.clamp(min=0))
    assert torch.allclose(scores.target_logit[:, 1:], expected[:, 1:])
    assert torch.allclose(scores.target_logit[:8, 0], expected[:8, 0])
    assert math.isnan(float(scores.target_logit[8, 0]))
    assert tuple(head.score(states[:0], targets[:0]).top.shape) == (0, 5)
    # The tolerance of a tie grows with the stored dtype's error, and is never zero.
    top, data = scores.top[:, 0], scores.top[:, 1]
    tight, loose = (head.tie_tolerance(states, top, data, eps) for eps in (2.0**-16, 2.0**-4))
    assert bool((tight > 0).all()) and bool((loose > 100 * tight).all())


def test_a_soft_capped_head_scores_the_capped_logits() -> None:
    """Gemma's final_logit_softcapping: the target samples from cap * tanh(logits / cap), so the
    data's log-probabilities are those of the capped logits (the top-k order is the same)."""
    head = _head()
    states = torch.randn(6, 16, generator=torch.Generator().manual_seed(3)) * 30  # [n, H]
    targets = torch.tensor([[3, 7, 49]] * 6)  # [n, 3]
    raw = head.norm(states) @ head.weight.T  # [n, V]
    head.softcap = 5.0
    capped = 5.0 * torch.tanh(raw / 5.0)
    scores = head.score(states, targets)
    assert torch.equal(scores.top, raw.topk(5, dim=1).indices)
    assert torch.allclose(scores.log_norm, torch.logsumexp(capped, dim=1), atol=1e-5)
    assert torch.allclose(scores.target_logit, capped.gather(1, targets), atol=1e-6)
    assert not torch.allclose(scores.log_norm, torch.logsumexp(raw, dim=1), atol=1e-2)
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
    assert logit_softcap({**config, "final_logit_softcapping": 30.0}) == 30.0
    assert logit_softcap({**config, "final_logit_softcapping": None}) is None
    assert logit_softcap({"architectures": ["LlamaForCausalLM"]}) is None
    with pytest.raises(ConfigError, match="expected a positive logit soft-cap, found -1"):
        logit_softcap({**config, "final_logit_softcapping": -1})


def test_a_state_after_the_norm_has_rms_one_over_the_weight() -> None:
    head = _head()
    states = torch.randn(6, 16) * torch.tensor([[1.0], [5.0], [30.0], [0.2], [7.0], [2.0]])
    before = head.post_norm_ratio(states)
    after = head.post_norm_ratio(head.norm(states))
    assert bool(((after - 1).abs() < 1e-4).all())
    assert bool(((before - 1).abs() > 0.05).any())


@pytest.mark.parametrize(
    ("hits", "positions", "verdict"),
    [
        ([2, 90, 3], 100, ("aligned", 0)),
        ([60, 5, 4], 100, ("shifted", -1)),
        ([1, 2, 40], 100, ("shifted", 1)),
        ([3, 5, 4], 100, ("undecided", None)),  # no shift predicts: a random model
        ([30, 40, 10], 100, ("undecided", None)),  # two shifts close: not decided
        ([0, 9, 0], 9, ("undecided", None)),  # too few positions
    ],
)
def test_alignment_verdicts(
    hits: list[int], positions: int, verdict: tuple[str, int | None]
) -> None:
    assert alignment_verdict(hits, positions) == verdict


def test_the_lm_head_is_found_or_refused_by_name(tmp_path: Path) -> None:
    plain = write_model(tmp_path / "plain")
    config = model_config()
    assert find_head(plain, config) == ("model.safetensors", "lm_head.weight", False)
    tied = write_model(tmp_path / "tied", tied=True)
    assert find_head(tied, model_config(tied=True))[1:] == ("model.embed_tokens.weight", True)
    unsaid = {k: v for k, v in model_config(tied=True).items() if k != "tie_word_embeddings"}
    assert find_head(tied, unsaid)[2]  # no head stored, tying unsaid: the embeddings
    with pytest.raises(
        ConfigError, match=r"no LM head weights found: .*tie_word_embeddings is false"
    ):
        find_head(write_model(tmp_path / "headless", head=False), config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no LM head weights found: .*no safetensors files"):
        find_head(tmp_path / "empty", config)
    with pytest.raises(ConfigError, match=r"audit device: expected auto, cpu or cuda, found 'tpu'"):
        choose_device("tpu", 1)
    if not torch.cuda.is_available():
        assert choose_device("auto", 1).type == "cpu"
        with pytest.raises(
            ConfigError, match=r"expected a CUDA device \(--device cuda\), found none"
        ):
            choose_device("cuda", 1)


def test_the_report_as_json_markdown_and_plots(tmp_path: Path) -> None:
    from hsx.audit import audit_store, markdown
    from hsx.audit.plots import PLOTS, draw

    model = write_model(tmp_path / "model")
    with HostPipeline(PipelineSettings(), engine_queue_limit(4096, None)) as host:
        url = write_store(host, str(tmp_path / "store.zarr"), model)
    report = audit_store(url)
    data = json.loads(json.dumps(report.to_json()))
    assert data["ok"] and data["masked"]["top1"] == data["masked"]["positions"] > 0
    assert {"0", "1-15", "16-127"} <= set(data["norm_percentiles"][0]["by_position"])
    images = draw(report, tmp_path / "plots")
    assert sorted(images) == sorted(PLOTS)
    for name, png in images.items():
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
        assert (tmp_path / "plots" / f"{name}.png").read_bytes() == png
    text = markdown(report, images)
    assert text.count("data:image/png;base64,") == len(PLOTS)
    assert "alignment: aligned" in text


def test_ids_past_the_head_s_vocabulary_are_no_target() -> None:
    """A padded tokenizer's ids (none of the head's rows) score nothing and spoil no mean."""
    import numpy as np

    from hsx.audit.agreement import Positions, score_positions
    from hsx.audit.results import ChunkAudit, SampleAudit

    head = _head(vocab=50)
    n = 4
    found = Positions(
        rows=np.arange(n),
        samples=np.zeros(n, dtype=np.int64),
        offsets=np.arange(n),
        ends=np.arange(n) - n,
        targets=torch.tensor([[1, 2, 3], [2, 60, 4], [3, 4, 70], [4, 5, 6]]),  # [n, 3]
        masked=np.ones(n, dtype=bool),
        states=torch.randn(n, 2, 16, generator=torch.Generator().manual_seed(3)),
    )
    audit = ChunkAudit(0, 1, n, n)
    audit.sample_audits = [SampleAudit(0, 0, n, n)]
    assert score_positions(head, found, audit, False, 2.0**-16) == ([], "")
    assert audit.masked.positions == 3 and math.isfinite(audit.masked.log_prob)
    assert audit.shift_positions == 2  # the row whose +1 target is id 70 has no pair
