"""Static preflight: resolution, capture contract, signatures, weights, tokenizer, resources.

No engine and no weights: vLLM's model modules are imported (seconds) but nothing is instantiated.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from hsx.model.layers import convert_layer_ids, default_layer_ids
from hsx.preflight.contract import capture_id_range, check_capture_contract, check_tokenizer
from hsx.preflight.report import CheckResult, PreflightReport, Status
from hsx.preflight.resolve import (
    ArchitectureResolutionError,
    ResolvedArchitecture,
    check_resolution,
    resolve_architecture,
)
from hsx.preflight.resources import check_resources, estimate_param_count, estimate_weight_bytes
from hsx.preflight.signatures import (
    CallSite,
    check_override_signatures,
    check_signatures,
    compare_call,
)
from hsx.preflight.weights import INDEX_NAME, check_weights

pytestmark = pytest.mark.timeout(120)

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def load_config(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / name / "config.json").read_text())


@pytest.fixture(scope="module")
def kimi() -> dict[str, Any]:
    return load_config("kimi-k2")


@pytest.fixture(scope="module")
def kimi_resolved(kimi: dict[str, Any]) -> ResolvedArchitecture:
    return resolve_architecture(kimi)


@pytest.fixture(scope="module")
def llama() -> dict[str, Any]:
    return load_config("llama-3.1-8b")


# --------------------------------------------------------------------------- layers


def test_default_layer_ids() -> None:
    assert default_layer_ids(61) == (2, 30, 58, 61)
    assert default_layer_ids(32) == (2, 16, 29, 32)
    assert default_layer_ids(4) == (1, 2, 4)  # deduplicated, sorted, clamped to 1..L


def test_convert_layer_ids_both_ways() -> None:
    # SpecForge/ModelOpt's default (1, L//2-1, L-4) is vLLM's (2, L//2, L-3): the same tensors.
    n = 61
    assert convert_layer_ids((1, n // 2 - 1, n - 4), "specforge") == (2, n // 2, n - 3)
    assert convert_layer_ids((2, 30, 58, 61), "vllm", "specforge") == (1, 29, 57, 60)
    assert convert_layer_ids((5, 7), "vllm") == (5, 7)
    with pytest.raises(ValueError, match="no specforge equivalent"):
        convert_layer_ids((0, 3), "vllm", "specforge")
    with pytest.raises(ValueError, match="Unknown layer-id convention"):
        convert_layer_ids((1,), "eagle")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- resolve


@pytest.mark.vllm
def test_resolve_kimi_k2_chain(kimi_resolved: ResolvedArchitecture) -> None:
    r = kimi_resolved
    assert r.chain == [
        "DeepseekV3ForCausalLM",
        "vllm.model_executor.models.deepseek_v2",
        "DeepseekV2Model",
    ]
    assert r.backbone_cls.__name__ == "DeepseekV2Model"  # there is no DeepseekV3Model
    assert r.decoder_layer_cls is not None
    assert r.decoder_layer_cls.__name__ == "DeepseekV2DecoderLayer"


@pytest.mark.vllm
def test_resolve_deepseek_v3_and_llama(llama: dict[str, Any]) -> None:
    ds = resolve_architecture(load_config("deepseek-v3"))
    assert ds.backbone_cls.__name__ == "DeepseekV2Model"
    r = resolve_architecture(llama)
    assert r.chain == ["LlamaForCausalLM", "vllm.model_executor.models.llama", "LlamaModel"]
    assert r.decoder_layer_cls is not None
    assert r.decoder_layer_cls.__name__ == "LlamaDecoderLayer"


@pytest.mark.vllm
def test_resolve_kimi_k25_follows_the_wrapped_language_model() -> None:
    r = resolve_architecture({"architectures": ["KimiK25ForConditionalGeneration"]})
    assert r.chain == [
        "KimiK25ForConditionalGeneration",
        "vllm.model_executor.models.kimi_k25",
        "DeepseekV2ForCausalLM",
        "DeepseekV2Model",
    ]
    assert r.language_model_cls.__name__ == "DeepseekV2ForCausalLM"


@pytest.mark.vllm
def test_resolution_check_notes_remote_code(kimi: dict[str, Any]) -> None:
    result = check_resolution(kimi)
    assert result.status == Status.PASS
    assert any("auto_map" in d for d in result.details)


@pytest.mark.vllm
def test_unknown_architecture_suggests_closest() -> None:
    with pytest.raises(ArchitectureResolutionError, match="Closest known: LlamaForCausalLM"):
        resolve_architecture({"architectures": ["LlamaForCasualLM"]})
    result = check_resolution({"architectures": ["LlamaForCasualLM"]})
    assert result.status == Status.FAIL and "LlamaForCausalLM" in result.summary
    with pytest.raises(ArchitectureResolutionError, match="architectures"):
        resolve_architecture({})


# --------------------------------------------------------------------------- contract


@pytest.mark.vllm
def test_contract_passes_default_ids(kimi: dict[str, Any], kimi_resolved: Any) -> None:
    result = check_capture_contract(kimi_resolved, kimi, default_layer_ids(61))
    assert result.status == Status.PASS, result


@pytest.mark.vllm
def test_contract_rejects_out_of_range_and_duplicates(
    kimi: dict[str, Any], kimi_resolved: Any
) -> None:
    too_high = check_capture_contract(kimi_resolved, kimi, (2, 62))
    assert too_high.status == Status.FAIL and "[62]" in too_high.summary
    assert "1..61" in too_high.summary
    zero = check_capture_contract(kimi_resolved, kimi, (0, 30))
    assert zero.status == Status.FAIL and "[0]" in zero.summary
    assert "residual is None" in zero.details[0]
    dupes = check_capture_contract(kimi_resolved, kimi, (2, 2, 30))
    assert dupes.status == Status.FAIL and "duplicates [2]" in dupes.summary


@pytest.mark.vllm
def test_id_zero_is_valid_for_llama(llama: dict[str, Any]) -> None:
    r = resolve_architecture(llama)
    assert capture_id_range(r, 32).low == 0
    assert check_capture_contract(r, llama, (0, 16, 32)).status == Status.PASS


@pytest.mark.vllm
def test_contract_fails_without_eagle3_support() -> None:
    config = {"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 32}
    result = check_capture_contract(resolve_architecture(config), config, (2, 16))
    assert result.status == Status.FAIL
    assert "SupportsEagle3" in result.summary and "transformers reference path" in result.summary
    # Mixtral lacks the interface too, and hsx's own hooks capture it (in this process only).
    mixtral = {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 32}
    resolved = resolve_architecture(mixtral)
    hooked = check_capture_contract(resolved, mixtral, (2, 16))
    assert hooked.status == Status.PASS and "captured by hsx's hooks" in hooked.summary
    served = check_capture_contract(resolved, mixtral, (2, 16), "engine.url (hsx serve servers)")
    assert served.status == Status.FAIL and "found engine.url" in served.summary


# --------------------------------------------------------------------------- signatures


def _layer_forward() -> Any:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2DecoderLayer

    return DeepseekV2DecoderLayer.forward


@pytest.mark.vllm
def test_seed_call_site_is_flagged_for_llama_4_scaling() -> None:
    # The call that started hsx: layer(hidden_states=..., positions=..., residual=...).
    seed = CallSite(keywords=("hidden_states", "positions", "residual"))
    lines = compare_call(_layer_forward(), seed, "DeepseekV2DecoderLayer")
    assert len(lines) == 1, lines
    assert "'llama_4_scaling'" in lines[0]
    assert "DeepseekV2Model.forward" in lines[0] and "deepseek_v2.py" in lines[0]


@pytest.mark.vllm
def test_model_matching_call_site_is_clean() -> None:
    correct = CallSite(positional=("positions", "hidden_states", "residual", "llama_4_scaling"))
    assert compare_call(_layer_forward(), correct, "DeepseekV2DecoderLayer") == []


@pytest.mark.vllm
def test_positional_order_and_unknown_keyword_are_flagged() -> None:
    swapped = CallSite(positional=("hidden_states", "positions", "residual"), keywords=("scale",))
    lines = compare_call(_layer_forward(), swapped, "DeepseekV2DecoderLayer")
    text = "\n".join(lines)
    assert "positional argument 1: expected 'positions'" in text
    assert "found 'hidden_states'" in text
    assert "keyword 'scale'" in text


@pytest.mark.vllm
def test_check_signatures_on_resolved_model(kimi_resolved: ResolvedArchitecture) -> None:
    seed = CallSite(keywords=("hidden_states", "positions", "residual"))
    bad = check_signatures(kimi_resolved, {"decoder_layer.forward": seed})
    assert bad.status == Status.FAIL and "llama_4_scaling" in bad.summary
    assert check_signatures(kimi_resolved, {}).status == Status.PASS


@pytest.mark.vllm
def test_kv_connector_override_signatures() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    assert check_override_signatures(ExampleHiddenStatesConnector, KVConnectorBase_V1) == []

    class BadConnector(ExampleHiddenStatesConnector):
        def wait_for_layer_load(self, name: str) -> None:  # base: layer_name
            return None

        def start_load_kv(self, forward_context: Any, extra: int) -> None:  # no **kwargs
            return None

    lines = check_override_signatures(BadConnector, KVConnectorBase_V1)
    text = "\n".join(lines)
    assert "wait_for_layer_load" in text and "expected 'layer_name'" in text
    assert "start_load_kv" in text and "**kwargs" in text
    assert "'extra'" in text


# --------------------------------------------------------------------------- weights


def _tiny_model(tmp_path: Path) -> Path:
    from safetensors.numpy import save_file

    shards = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": np.zeros((16, 8), np.float32),
            "model.layers.0.mlp.weight": np.ones((8, 8), np.float32),
        },
        "model-00002-of-00002.safetensors": {"lm_head.weight": np.zeros((16, 8), np.float16)},
    }
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(tmp_path / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "intermediate_size": 8,
    "num_attention_heads": 2,
    "vocab_size": 16,
    "torch_dtype": "float32",
}


def test_weights_pass_on_complete_model(tmp_path: Path) -> None:
    result = check_weights(_tiny_model(tmp_path), TINY_CONFIG)
    assert result.status in (Status.PASS, Status.WARN), result
    assert "2 shard(s), 3 tensors" in result.summary


def test_weights_missing_shard(tmp_path: Path) -> None:
    model = _tiny_model(tmp_path)
    (model / "model-00002-of-00002.safetensors").unlink()
    result = check_weights(model, TINY_CONFIG)
    assert result.status == Status.FAIL
    assert "model-00002-of-00002.safetensors" in result.summary and "missing" in result.summary


def test_weights_truncated_shard(tmp_path: Path) -> None:
    model = _tiny_model(tmp_path)
    shard = model / "model-00001-of-00002.safetensors"
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size - 10)
    result = check_weights(model, TINY_CONFIG)
    assert result.status == Status.FAIL
    assert shard.name in result.summary and "truncated" in result.summary
    assert f"expected {size:,} bytes; found {size - 10:,}" in result.summary


def test_weights_index_names_absent_tensor(tmp_path: Path) -> None:
    model = _tiny_model(tmp_path)
    index = json.loads((model / INDEX_NAME).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (model / INDEX_NAME).write_text(json.dumps(index))
    result = check_weights(model, TINY_CONFIG)
    assert result.status == Status.FAIL and "model.norm.weight" in result.summary


def test_weights_unknown_dtype_and_garbage_header(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    result = check_weights(tmp_path, TINY_CONFIG)
    assert result.status == Status.FAIL and "'F7'" in result.summary
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    assert "header length" in check_weights(tmp_path, TINY_CONFIG).summary


def test_no_weights_warns(tmp_path: Path) -> None:
    result = check_weights(CONFIGS / "kimi-k2", load_config("kimi-k2"))
    assert result.status == Status.WARN and "dummy weights" in result.summary


def test_weights_far_from_config_estimate_warns(tmp_path: Path) -> None:
    big = {**TINY_CONFIG, "hidden_size": 4096, "vocab_size": 32000}
    result = check_weights(_tiny_model(tmp_path), big)
    assert result.status == Status.WARN and "expected ~" in result.details[-1]


# --------------------------------------------------------------------------- tokenizer


def _save_tokenizer(path: Path, chat_template: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(path))
    return path


def test_tokenizer_with_chat_template(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    result = check_tokenizer(_save_tokenizer(tmp_path, template))
    assert result.status == Status.PASS, result


def test_tokenizer_without_chat_template(tmp_path: Path) -> None:
    result = check_tokenizer(_save_tokenizer(tmp_path, None))
    assert result.status == Status.FAIL
    assert "no chat template" in result.summary and "tokenizer_config.json" in result.summary


def test_tokenizer_missing(tmp_path: Path) -> None:
    result = check_tokenizer(tmp_path)
    assert result.status == Status.FAIL and "tokenizer.json" in result.summary


# --------------------------------------------------------------------------- resources


def test_param_estimates_match_published_sizes(kimi: dict[str, Any], llama: dict[str, Any]) -> None:
    assert 1.0e12 < estimate_param_count(kimi) < 1.06e12  # "1T total parameters"
    assert 7.9e9 < estimate_param_count(llama) < 8.1e9
    assert 6.7e11 < estimate_param_count(load_config("deepseek-v3")) < 6.9e11  # 671B + MTP
    assert estimate_weight_bytes(kimi) == estimate_param_count(kimi)  # FP8: one byte each


def test_resources_pass_and_fail(
    kimi: dict[str, Any], llama: dict[str, Any], tmp_path: Path
) -> None:
    h200 = 141 * 10**9
    ok = check_resources(llama, 1, h200, 2 * 4 * 4096, 1000, str(tmp_path / "store.zarr"))
    assert ok.status == Status.PASS, ok
    too_big = check_resources(kimi, 1, h200, 2 * 4 * 7168, None, "s3://bucket/store")
    assert too_big.status == Status.FAIL and any("needs TP >=" in d for d in too_big.details)
    no_disk = check_resources(llama, 1, h200, 2 * 4 * 4096, 10**15, str(tmp_path / "s"))
    assert no_disk.status == Status.FAIL and any("store does not fit" in d for d in no_disk.details)
    unknown = check_resources(llama, 1, None, 1, None, "s3://bucket/store")
    assert unknown.status == Status.PASS and "unknown" in unknown.summary


# --------------------------------------------------------------------------- report


def test_report_renders_everywhere() -> None:
    report = PreflightReport(
        "/models/kimi",
        [
            CheckResult("resolve", Status.PASS, "A -> B"),
            CheckResult("signatures", Status.FAIL, "1 mismatch | pipe", ("line one", "line two")),
        ],
    )
    assert not report.ok
    assert json.loads(json.dumps(report.to_dict()))["counts"] == {"pass": 1, "warn": 0, "fail": 1}
    md = report.to_markdown()
    assert "| signatures |" in md and "\\|" in md and "- line two" in md
    console = Console(record=True, width=120)
    report.render_table(console)
    text = console.export_text()
    assert "FAIL" in text and "line one" in text
    with pytest.raises(ValueError, match="empty"):
        CheckResult("x", Status.PASS, " ")
