"""The real vLLM engine on both tiny models: states captured by hsx's connector, written to a
real Zarr store and read back through the reader equal HF transformers' states (fp32) within
1e-4 at every captured layer and token, for prompts of different lengths in one batch."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hsx.data.tokenization import iter_conversations, tokenize_conversation
from hsx.engine.vllm_engine import engine_is_loaded, get_engine
from hsx.extraction.chunk_extraction import RunContext
from hsx.extraction.run import extract_work_chunk, run_spec
from hsx.extraction.steps import plan_and_create_store
from hsx.plan.building import load_tokenizer
from hsx.preflight.hf_reference import hf_hidden_states, load_hf_model
from hsx.store.reader import HiddenStatesReader
from hsx.store.verify import verify_store
from hsx.store.zarr_store import ExtractionStore
from tests.conftest import make_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SAMPLES = 24


def run_extraction(settings: object) -> None:
    summary = plan_and_create_store(settings)  # type: ignore[arg-type]
    assert len(summary.pending) >= 2, "want several work chunks"
    for index in summary.pending:
        record = extract_work_chunk(settings, index, RunContext("test-run"))  # type: ignore[arg-type]
        assert record is not None and record.tokens > 0


def assert_matches_hf(model_dir: Path, dataset: Path, store_url: str) -> None:
    reader = HiddenStatesReader(store_url)
    assert len(reader) == SAMPLES == reader.num_samples
    samples = [reader.sample(i) for i in range(SAMPLES)]
    lengths = {s.input_ids.shape[0] for s in samples}
    assert len(lengths) > 5, f"want prompts of different lengths, found {sorted(lengths)}"
    hf = load_hf_model(model_dir)
    references = hf_hidden_states(hf, [s.input_ids.numpy() for s in samples], reader.layer_ids)
    worst = 0.0
    for sample, reference in zip(samples, references, strict=True):
        assert sample.hidden_states.shape == reference.shape
        assert sample.hidden_states.dtype == torch.float32
        worst = max(worst, float((sample.hidden_states - reference).abs().max()))
    assert worst < 1e-4, f"max abs difference against HF: {worst}"
    # Loss masks: exactly the assistant turns, as tokenized from the dataset.
    tokenizer = load_tokenizer(model_dir)
    for conversation, sample in zip(iter_conversations(dataset), samples, strict=False):
        expected = tokenize_conversation(tokenizer, conversation.messages, 2048)
        assert np.array_equal(sample.input_ids.numpy(), expected.input_ids)
        assert np.array_equal(sample.loss_mask.numpy(), expected.loss_mask.astype(bool))
        masked = tokenizer.decode(sample.input_ids[sample.loss_mask].tolist())
        for role, content in conversation.messages:
            if role == "assistant":
                assert content in masked


def test_tiny_llama_local_store_matches_hf(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    url = str(tmp_path / "llama.zarr")
    settings = make_settings(
        tiny_llama,
        sample_dataset,
        url,
        data={"max_samples": SAMPLES},
        layout={"min_work_chunk_tokens": 512, "rows_per_chunk": 64},
    )
    run_extraction(settings)
    assert verify_store(ExtractionStore.open(url)).ok
    reader = HiddenStatesReader(url)
    assert reader.layer_ids == (2, 4, 5, 8)  # EAGLE-3 default (2, L//2, L-3) + L for L=8
    assert_matches_hf(tiny_llama, sample_dataset, url)
    # The connector hands results over in page-aligned buffers, each request's rows starting on
    # a block: with 4 KiB rows (K=4, H=256, fp32) every result qualifies for the writer's
    # in-place O_DIRECT path.
    engine = get_engine(settings.model, settings.engine, run_spec(settings).layer_ids)
    results = engine.extract([np.arange(1, 200), np.arange(3, 40), np.arange(5, 300)])
    assert [tuple(r.shape) for r in results] == [(199, 4, 256), (37, 4, 256), (295, 4, 256)]
    assert [r.data_ptr() % 4096 for r in results] == [0, 0, 0]
    # A changed batch size (how hsx feeds the engine) reuses the loaded engine; a changed dtype
    # (what the engine computes) does not.
    fed_otherwise = settings.engine.model_copy(update={"batch_tokens": 64, "server_wait_s": 1.0})
    assert get_engine(settings.model, fed_otherwise, run_spec(settings).layer_ids) is engine
    built_otherwise = settings.engine.model_copy(update={"dtype": "bfloat16"})
    assert not engine_is_loaded(settings.model, built_otherwise, run_spec(settings).layer_ids)


def test_a_prompt_vllm_refuses_fails_alone(tiny_llama: Path, sample_dataset: Path) -> None:
    """A prompt with no room for the sampled token is refused by vLLM: that request fails with a
    fatal error naming it, and the engine keeps serving the others (it used to kill the engine
    driver, failing every chunk and every retry)."""
    from hsx.errors import RequestRefusedError, is_retryable

    settings = make_settings(tiny_llama, sample_dataset, "memory://unused")
    engine = get_engine(settings.model, settings.engine, run_spec(settings).layer_ids)
    too_long = np.arange(1, settings.engine.max_model_len + 1)  # [2048]: max_model_len tokens
    refused, fine = engine.submit([too_long, np.arange(1, 100)])
    with pytest.raises(
        RequestRefusedError, match=r"of 2048 tokens: expected vLLM to accept"
    ) as info:
        refused.result(timeout=60)
    assert not is_retryable(info.value)
    assert "2048" in repr(info.value.__cause__)
    assert tuple(fine.result(timeout=60).shape) == (99, 4, 256)
    assert engine.alive
    assert [tuple(r.shape) for r in engine.extract([np.arange(1, 2048)])] == [(2047, 4, 256)]


def test_tiny_deepseek_memory_store_matches_hf(tiny_deepseek: Path, sample_dataset: Path) -> None:
    url = f"memory://hsx-{uuid.uuid4().hex}/deepseek.zarr"
    # SpecForge numbering 1,3,7 == vLLM ids 2,4,8 (id 8 = final pre-norm state)
    settings = make_settings(
        tiny_deepseek,
        sample_dataset,
        url,
        data={"max_samples": SAMPLES},
        capture={"layer_ids": [1, 3, 7], "layer_convention": "specforge"},
        layout={"min_work_chunk_tokens": 512, "rows_per_chunk": 64},
    )
    run_extraction(settings)
    assert verify_store(ExtractionStore.open(url)).ok
    assert HiddenStatesReader(url).layer_ids == (2, 4, 8)
    assert_matches_hf(tiny_deepseek, sample_dataset, url)


def _extract_across_processes(
    model: Path, dataset: Path, url: str, engine: dict[str, object]
) -> dict[str, Any]:
    """Extract with a fresh engine of these settings; the stage timings of that run (the
    hand-over counts among them), once every state was checked against HF."""
    from hsx import timings
    from hsx.engine.vllm_engine import close_all_engines

    settings = make_settings(
        model,
        dataset,
        url,
        data={"max_samples": SAMPLES},
        engine=engine,
        layout={"min_work_chunk_tokens": 512, "rows_per_chunk": 64},
    )
    close_all_engines()
    timings.reset()
    try:
        run_extraction(settings)
    finally:
        close_all_engines()
    stages: dict[str, Any] = dict(timings.snapshot())
    assert verify_store(ExtractionStore.open(url)).ok
    assert_matches_hf(model, dataset, url)
    return stages


@pytest.mark.parametrize(
    ("ring_gib", "via"),
    [(None, "handover_ring"), (1e-4, "handover_file")],
    ids=["shared-memory-ring", "ring-full-spool-files"],
)
def test_engine_in_child_process_hands_states_over(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path, ring_gib: float | None, via: str
) -> None:
    """vLLM's default (and GPU) mode: the engine core in its own process. States come through
    the shared-memory ring; with a ring of one granule most requests find it full and come
    through spool files instead. Either way every state equals HF's."""
    stages = _extract_across_processes(
        tiny_llama,
        sample_dataset,
        str(tmp_path / "mp.zarr"),
        {"in_process": False, "result_ring_gib": ring_gib},
    )
    assert stages[via].count > 0, sorted(stages)
    if via == "handover_ring":
        assert "handover_file" not in stages  # the default ring holds every request in flight
    assert stages["engine:d2h_copy"].nbytes > 0  # the engine process's own timings came along


def test_tensor_parallel_2_on_cpu_every_state_once_equal_to_hf(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """TP=2 on vLLM's CPU build (two worker processes, gloo), the engine core in this process:
    rank 0's connector hands each request's states over through the ring exactly once (one
    announcement per sample), and they equal HF's."""
    stages = _extract_across_processes(
        tiny_llama,
        sample_dataset,
        str(tmp_path / "tp2.zarr"),
        {"tensor_parallel_size": 2, "in_process": True},
    )
    assert stages["handover_ring"].count == SAMPLES, sorted(stages)
    assert "handover_file" not in stages
