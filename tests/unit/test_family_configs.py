"""Every family's real full-size config.json (tests/fixtures/configs/, no weights): the probe's
reduced copy keeps every per-layer list consistent with its layer count and every kind of layer
the real model has, HF's own config class accepts it and builds the model; and static preflight
resolves each config (wrappers included), checks its layer ids against its layer count, says what
a token costs, and refuses, naming the reason, what hsx cannot capture correctly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hsx.model.config import text_config
from hsx.model.families import FAMILIES, Family, family_of, parity_note
from hsx.model.layer_structure import MAX_PATTERN_PERIOD, layer_structure
from hsx.model.layers import default_layer_ids
from hsx.preflight.hf_reference import text_decoder
from hsx.preflight.reduction import PROBE_CHUNK, PROBE_WINDOW, reduce_model

pytestmark = pytest.mark.timeout(300)

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
FIXTURES = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file())


def load(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / name / "config.json").read_text())


def hf_text_class(config: dict[str, Any]) -> Any:
    """The HF class of the model's text decoder (a wrapper's text model, per the registry)."""
    import transformers

    family = family_of(config)
    arch = config["architectures"][0]
    if family is not None and family.text_architecture is not None:
        arch = family.text_architecture
    return getattr(transformers, arch)


def test_every_family_has_a_real_config_and_every_config_a_family() -> None:
    assert {f.fixture for f in FAMILIES} <= set(FIXTURES)
    for name in FIXTURES:
        family = family_of(load(name))
        assert family is not None, f"{name}: no family names {load(name)['architectures']}"
    assert len(FAMILIES) >= 8


@pytest.mark.parametrize("name", FIXTURES)
def test_the_reduced_model_keeps_every_per_layer_list_consistent(name: str) -> None:
    """The defect of issue 43: a reduced gpt-oss kept 8 ``layer_types`` for 5 layers and HF's
    config refused itself. Every per-layer list now has the reduced layer count, every index
    list names reduced layers, every kind of layer survives, and HF builds the model."""
    import torch

    config = load(name)
    text = text_config(config)
    layers = int(text["num_hidden_layers"])
    ids = default_layer_ids(layers)
    reduced = reduce_model(text, ids, 1)
    cfg = reduced.config
    assert cfg["num_hidden_layers"] == reduced.layers == len(reduced.picks)
    original = layer_structure(text)
    for key in original.lists:
        assert len(cfg[key]) == reduced.layers, (key, cfg[key])
    for key in original.index_sets:
        assert all(0 <= i < reduced.layers for i in cfg[key]), (key, cfg[key])
    assert set(layer_structure(cfg).kinds()) == set(original.kinds())
    # The reduced pattern is the real one's, layer for layer.
    assert [layer_structure(cfg).kind(r) for r in range(reduced.layers)] == [
        original.kind(i) for i in reduced.picks
    ]
    if isinstance(text.get("sliding_window"), int):
        assert cfg["sliding_window"] == min(text["sliding_window"], PROBE_WINDOW)
    if isinstance(text.get("attention_chunk_size"), int):
        assert cfg["attention_chunk_size"] == min(text["attention_chunk_size"], PROBE_CHUNK)
    cls = hf_text_class(config)
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    hf_config = cls.config_class(**fields)  # strict: refuses inconsistent per-layer lists
    assert hf_config.num_hidden_layers == reduced.layers
    with torch.device("meta"):
        model = cls(hf_config)
    assert len(text_decoder(model).layers) == reduced.layers


def test_a_tiny_gpt_oss_with_eight_layer_types_reduces_to_five_layers() -> None:
    """The exact case of the issue: 8 layers with ``layer_types`` of 8, reduced to 5."""
    from transformers import GptOssConfig

    text = {
        "model_type": "gpt_oss",
        "num_hidden_layers": 8,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 4,
        "sliding_window": 128,
    }
    reduced = reduce_model(text, (2, 4, 5, 8), 0, wanted_layers=5)
    assert reduced.layers == 5 and len(reduced.config["layer_types"]) == 5
    assert reduced.config["layer_types"][:2] == ["sliding_attention", "full_attention"]
    fields = {k: v for k, v in reduced.config.items() if k != "model_type"}
    assert GptOssConfig(**fields).layer_types == reduced.config["layer_types"]


def test_an_irregular_pattern_keeps_one_layer_of_each_kind() -> None:
    kinds = ["full_attention"] * 20 + ["linear_attention"] + ["full_attention"] * 9
    structure = layer_structure({"num_hidden_layers": 30, "layer_types": kinds})
    assert structure.period() == 21 > MAX_PATTERN_PERIOD
    picks = structure.pick_layers(4)
    assert picks == (0, 1, 2, 20)
    assert structure.reduced_fields(picks)["layer_types"][-1] == "linear_attention"
    with pytest.raises(ValueError, match="expected at least 3 layers"):
        layer_structure(
            {"num_hidden_layers": 9, "layer_types": ["a"] * 7 + ["b", "c"]}
        ).pick_layers(2)


def test_kv_and_state_bytes_of_a_hybrid() -> None:
    """Qwen3-Next: 12 full-attention layers of 2 KV heads x 256 per token (bf16), plus the
    captured states; 36 Gated DeltaNet layers keep a state per sequence instead."""
    from hsx.engine.options import kv_bytes_per_token, linear_state_bytes

    config = load("qwen3-next-80b-a3b")
    assert kv_bytes_per_token(config, "bfloat16", 4) == (12 * 2 * 2 * 256 + 4 * 2048) * 2
    conv = 3 * (2 * 16 * 128 + 32 * 128)
    assert linear_state_bytes(config, "bfloat16") == 36 * (conv + 32 * 128 * 128) * 2
    assert linear_state_bytes(load("gpt-oss-20b"), "bfloat16") == 0


def test_parity_notes_name_what_is_unchecked() -> None:
    gpt_oss, qwen_next = load("gpt-oss-20b"), load("qwen3-next-80b-a3b")
    assert "warning" not in parity_note(gpt_oss, probe_ran=False, on_gpu=False)
    assert "warning" not in parity_note(qwen_next, probe_ran=True, on_gpu=False)
    refused = parity_note(qwen_next, probe_ran=False, on_gpu=False)
    assert (
        refused["cpu_parity"] == "refused"
        and "not established for qwen3-next" in (refused["warning"])
    )
    on_gpu = parity_note(gpt_oss, probe_ran=False, on_gpu=True)
    assert "on GPUs" in on_gpu["warning"]
    unknown = parity_note({"architectures": ["FooForCausalLM"]}, probe_ran=False, on_gpu=False)
    assert unknown["family"] is None and "FooForCausalLM" in unknown["warning"]


# --------------------------------------------------------------------------- static preflight


def _by_check(results: list[Any]) -> dict[str, Any]:
    return {r.check: r for r in results}


def _family(name: str) -> Family:
    family = family_of(load(name))
    assert family is not None
    return family


@pytest.mark.vllm
@pytest.mark.parametrize("name", FIXTURES)
def test_static_preflight_on_every_real_config(name: str) -> None:
    """Resolution through wrappers, layer ids against the layer count, bytes per token: in
    seconds, without weights. What hsx cannot capture correctly fails with its reason."""
    import time

    from hsx.preflight.report import Status
    from hsx.preflight.run import static_checks
    from settings import CaptureSettings, EngineSettings

    config = load(name)
    text = text_config(config)
    layers = int(text["num_hidden_layers"])
    started = time.perf_counter()
    results, context = static_checks(
        CONFIGS / name, CaptureSettings(), EngineSettings(), dataset_tokens=1000
    )
    seconds = time.perf_counter() - started
    checks = _by_check(results)
    family = _family(name)
    hidden = int(text["hidden_size"])
    resolve = checks["resolve"]
    if family.text_architecture and resolve.status == Status.FAIL:
        # A wrapper whose vision module imports torchvision, absent from the CPU build.
        assert "torchvision" in resolve.summary, resolve.summary
        assert any(
            family.text_architecture in d or "does not resolve here" in d for d in resolve.details
        ), resolve.details
    else:
        assert resolve.status in (Status.PASS, Status.WARN), resolve.summary
        if family.text_architecture:
            assert context["resolved"].language_architecture.endswith("ForCausalLM")
    contract = checks.get("contract")
    if family.cpu_parity.status == "refused":
        # Refused on this CPU build, naming why, before any load.
        assert checks["family"].status == Status.FAIL
        assert family.cpu_parity.detail in checks["family"].summary
    else:
        assert checks["family"].status in (Status.PASS, Status.WARN), checks["family"].summary
    if resolve.status == Status.FAIL and contract is None:
        # Neither the wrapper nor its text model resolves here (Qwen3.5: one module for both).
        assert any("does not resolve here either" in d for d in resolve.details), resolve.details
    elif family.cpu_parity.status == "refused" and family.name != "minimax-m2":
        # The generic checks find it too (on a GPU as well): no EAGLE-3 interface, or hybrid.
        assert contract is not None and contract.status == Status.FAIL, contract
        assert "SupportsEagle3" in contract.summary or "hybrid" in contract.summary
    elif resolve.status != Status.FAIL:
        assert contract is not None
        assert contract.status == Status.PASS, contract.summary
        assert str(default_layer_ids(layers)) in contract.summary
        assert f"..{layers} " in contract.summary
    # Bytes a token of the store takes: K states of H in bf16, plus its id and mask.
    k = len(default_layer_ids(layers))
    assert any(f"{k * hidden * 2 + 5:,} B/token" in d for d in checks["resources"].details)
    if layer_structure(text).linear_attention_layers():
        # A hybrid's memory: attention KV per token, Gated DeltaNet state per sequence.
        assert any("linear-attention state" in d for d in checks["engine"].details)
    assert seconds < 60, f"static preflight of {name} took {seconds:.1f} s"


@pytest.mark.vllm
def test_layer_ids_beyond_the_layer_count_fail_for_every_family() -> None:
    from hsx.preflight.report import Status
    from hsx.preflight.run import static_checks
    from settings import CaptureSettings, EngineSettings

    for name in ("gpt-oss-20b", "qwen3-30b-a3b", "minimax-m2", "kimi-k2.5"):
        layers = int(text_config(load(name))["num_hidden_layers"])
        results, _ = static_checks(
            CONFIGS / name, CaptureSettings(layer_ids=[2, layers + 1]), EngineSettings()
        )
        contract = _by_check(results)["contract"]
        assert contract.status == Status.FAIL and f"[{layers + 1}]" in contract.summary, (
            name,
            contract.summary,
        )


def test_a_run_without_preflight_on_an_unchecked_family_says_so(tmp_path: Path) -> None:
    """Preflight off (HSX_RUN__PREFLIGHT=false) on a family whose parity is not established:
    the run record carries the warning, and `hsx info`'s line for the run shows it; a family
    established on the CPU build carries none."""
    import uuid

    from flows.store_cli import _family_line, _run_line
    from hsx.store.run_records import RunAttempt, record_attempt, records_beside
    from settings import HsxSettings

    def run_on(config: dict[str, Any], preflight: bool) -> dict[str, Any]:
        model = tmp_path / uuid.uuid4().hex
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        dataset = tmp_path / "data.jsonl"
        dataset.write_text("")
        store = f"memory://hsx-{uuid.uuid4().hex}/s.zarr"
        settings = HsxSettings(
            model=model, dataset=dataset, store=store, run={"preflight": preflight}
        )
        record_attempt(settings, RunAttempt("r1", 1, 0.0), "failed", {"failed_in": "plan"})
        [record] = records_beside(store)
        return record

    qwen_next = run_on(load("qwen3-next-80b-a3b"), preflight=False)
    assert "not established for qwen3-next" in qwen_next["parity"]["warning"]
    assert "WARNING: parity with HF transformers is not established" in _run_line(qwen_next)
    assert "warning" not in run_on(load("qwen3-next-80b-a3b"), preflight=True)["parity"]
    unknown = run_on(
        {**load("mistral-7b-v0.3"), "architectures": ["Foo"], "model_type": "foo"}, preflight=False
    )
    assert unknown["parity"]["family"] is None and "['Foo']" in unknown["parity"]["warning"]
    established = run_on(load("gpt-oss-20b"), preflight=False)
    assert "warning" not in established["parity"] and "WARNING" not in _run_line(established)
    line = _family_line({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"})
    assert line.startswith("family gpt-oss: CPU parity with HF established (tiny gpt-oss")


@pytest.mark.vllm
def test_hsx_hooks_are_refused_where_the_engine_is_not_built_here() -> None:
    """Mixtral, GLM-4 MoE and Gemma-3 are captured by hooks registered in the process that
    builds the engine: a served, child-process or TP>1 engine would load and then fail."""
    from hsx.preflight.report import Status
    from hsx.preflight.run import static_checks
    from settings import CaptureSettings, EngineSettings

    here, _ = static_checks(CONFIGS / "mixtral-8x7b", CaptureSettings(), EngineSettings())
    assert _by_check(here)["contract"].status == Status.PASS
    assert _by_check(here)["signatures"].status == Status.PASS
    for kwargs, named in (
        ({"served": True}, "hsx serve"),
        ({"engine": EngineSettings(in_process=False)}, "engine.in_process false"),
        ({"engine": EngineSettings(tensor_parallel_size=2)}, "tensor_parallel_size 2"),
    ):
        engine = kwargs.pop("engine", EngineSettings())
        results, _ = static_checks(CONFIGS / "glm-4.5", CaptureSettings(), engine, **kwargs)
        contract = _by_check(results)["contract"]
        assert contract.status == Status.FAIL and named in contract.summary, contract.summary
