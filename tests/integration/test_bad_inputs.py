"""Every bad input of docs/BAD_INPUTS.md through the real ``hsx extract`` CLI: an error naming the
problem (file:line, key, expected and found), a non-zero exit, and nothing committed (no commit
records; for a failure before planning no zarr.json at all).

The fast groups fail before Prefect or the engine start (a few seconds each: the CLI's own
start). The ``slow`` groups fail inside the flow, after the CLI started its temporary Prefect
server: at the flow's preflight (model-folder problems that need the tokenizer, vLLM's registry
or the weights) or at planning (a store planned with other inputs)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli import GOOD, GOOD_LINE, assert_nothing_written, extract, said


def assert_refused(result: subprocess.CompletedProcess[str], *patterns: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout[-3000:], result.stderr[-3000:])
    text = said(result)
    for pattern in patterns:
        assert re.search(pattern, text), (pattern, text[-3000:])


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD_LINE + b"\n")
    return path


# --- the dataset's lines: before Prefect, seconds ---------------------------------------------


def _conversation(**fields: object) -> bytes:
    return json.dumps(fields).encode()


LINE_CASES: list[tuple[str, list[bytes], str]] = [
    (
        "image-part",
        [GOOD_LINE, _conversation(messages=[{"role": "user", "content": [{"type": "image_url"}]}])],
        r"data\.jsonl:2: message 0: part 0: expected text parts only .* found \{'type': 'image_url'\}",
    ),
    (
        "reserved-id",
        [GOOD_LINE, _conversation(id="hsx:0", messages=[{"role": "assistant", "content": "x"}])],
        r"data\.jsonl:2: expected an 'id' not starting with 'hsx:' .* found 'hsx:0'",
    ),
    (
        "sharegpt-speaker",
        [GOOD_LINE, _conversation(conversations=[{"from": "bot", "value": "x"}])],
        r"data\.jsonl:2: message 0: expected 'role', or a ShareGPT 'from' in .* found 'bot'",
    ),
    (
        "pretokenized-mask-length",
        [GOOD_LINE, _conversation(input_ids=[1, 2, 3], loss_mask=[0, 1])],
        r"data\.jsonl:2: expected 'loss_mask' as long as 'input_ids' \(3\), found 2",
    ),
    (
        "not-json",
        [GOOD_LINE, b"{oops"],
        r"data\.jsonl:2: expected a JSON object, found text that is not JSON .*'\{oops'",
    ),
    (
        "json-not-an-object",
        [GOOD_LINE, b"[1, 2]"],
        r"data\.jsonl:2: expected a JSON object with a 'messages' list, found list \[1, 2\]",
    ),
    (
        "no-messages-key",
        [GOOD_LINE, _conversation(chat=[])],
        r"data\.jsonl:2: expected a non-empty 'messages' list, found no messages or "
        r"conversations or conversation key",
    ),
    (
        "messages-not-a-list",
        [GOOD_LINE, _conversation(messages="hi")],
        r"data\.jsonl:2: expected a non-empty 'messages' list, found 'hi'",
    ),
    (
        "empty-conversation",
        [GOOD_LINE, _conversation(messages=[])],
        r"data\.jsonl:2: expected a non-empty 'messages' list, found \[\]",
    ),
    (
        "message-not-an-object",
        [GOOD_LINE, _conversation(messages=["hi"])],
        r"data\.jsonl:2: message 0: expected an object with 'role' and 'content' \(or ShareGPT's "
        r"'from' and 'value'\), found str 'hi'",
    ),
    (
        "content-not-a-string",
        [GOOD_LINE, _conversation(messages=[{"role": "user", "content": 5}])],
        r"data\.jsonl:2: message 0: expected string 'content' \(or a list of text parts\), "
        r"found int 5",
    ),
    (
        "role-not-a-string",
        [GOOD_LINE, _conversation(messages=[{"role": ["user"], "content": "x"}])],
        r"data\.jsonl:2: message 0: expected a role in \('system', 'user', 'assistant', 'tool'\), "
        r"found \['user'\]",
    ),
    (
        "unknown-role",
        [GOOD_LINE, _conversation(messages=[{"role": "bot", "content": "x"}])],
        r"data\.jsonl:2: message 0: expected a role in \('system', 'user', 'assistant', "
        r"'tool'\), found 'bot'",
    ),
    (
        "no-assistant-turn",
        [GOOD_LINE, _conversation(messages=[{"role": "user", "content": "x"}])],
        r"data\.jsonl:2: expected at least one 'assistant' message, found roles \['user'\]",
    ),
    (
        "id-not-a-string",
        [GOOD_LINE, _conversation(id=[7], **GOOD)],
        r"data\.jsonl:2: expected 'id' to be a string, found list \[7\]",
    ),
    (
        "duplicate-id",
        [
            _conversation(id="a", **GOOD),
            _conversation(id="b", **GOOD),
            _conversation(id="a", **GOOD),
        ],
        r"data\.jsonl:3: expected each id once, found id 'a' again: \S+data\.jsonl:1 and "
        r"\S+data\.jsonl:3 both use it",
    ),
    (
        "invalid-utf8",
        [GOOD_LINE, b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'],
        r"data\.jsonl:2: expected a JSON object in UTF-8 text, found a byte that is not UTF-8 "
        r"\(invalid continuation byte: b'\\xe9' at byte 46 of the line\)",
    ),
    ("empty-file", [], r"data\.jsonl: expected at least one conversation, found an empty dataset"),
    (
        "blank-lines-only",
        [b"", b"   ", b""],
        r"data\.jsonl: expected at least one conversation, found an empty dataset \(or only blank",
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("lines", "expected"), [c[1:] for c in LINE_CASES], ids=[c[0] for c in LINE_CASES]
)
def test_a_bad_dataset_line_is_refused_by_its_line(
    lines: list[bytes], expected: str, tiny_llama: Path, tmp_path: Path
) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    store = tmp_path / "store"
    assert_refused(extract(tiny_llama, path, store), re.escape(str(tmp_path)) + "/" + expected)
    assert_nothing_written(store)


# What hsx says of a dataset path that is no file (PATH: the path given); docs/BAD_INPUTS.md
# quotes these (tests/unit/test_bad_inputs_doc.py checks it).
NO_FILE_CASES = {
    "missing": "PATH: expected a dataset file or folder, found nothing there",
    "directory": "PATH: expected a save_to_disk folder (dataset_info.json, state.json or "
    "dataset_dict.json) or files ending in",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(NO_FILE_CASES))
def test_a_dataset_path_that_is_no_file(kind: str, tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    if kind == "directory":
        path.mkdir()
    store = tmp_path / "store"
    expected = NO_FILE_CASES[kind].replace("PATH", str(path), 1)
    assert_refused(extract(tiny_llama, path, store), re.escape(expected))
    assert_nothing_written(store)


# --- the model folder's config.json: before Prefect, seconds ----------------------------------


def _write_config(text: bytes) -> Callable[[Path], None]:
    return lambda model: (model / "config.json").write_bytes(text)


def _edit_config(edit: Callable[[dict[str, object]], None]) -> Callable[[Path], None]:
    def apply(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        edit(config)
        (model / "config.json").write_text(json.dumps(config))

    return apply


CONFIG_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    (
        "missing-config-json",
        lambda model: (model / "config.json").unlink(),
        r"model folder .*/model: expected config\.json, found \[.*'model\.safetensors'",
    ),
    (
        "config-not-json",
        _write_config(b'{"architectures": ["LlamaForCausalLM"],'),
        r"/model/config\.json: expected JSON, found a parse error: Expecting property name",
    ),
    (
        "config-not-utf8",
        _write_config(b'{"architectures": ["Llama\xffForCausalLM"]}'),
        r"/model/config\.json: expected JSON, found a parse error: .*utf-8.*0xff",
    ),
    (
        "config-not-an-object",
        _write_config(b'["LlamaForCausalLM"]'),
        r"/model/config\.json: expected a JSON object of model settings, found list",
    ),
    (
        "no-architectures",
        _edit_config(lambda c: c.pop("architectures")),
        r"/model/config\.json: expected 'architectures' to list the model class "
        r"\(e\.g\. \['LlamaForCausalLM'\]\), found no 'architectures' key",
    ),
    (
        "empty-architectures",
        _edit_config(lambda c: c.update(architectures=[])),
        r"/model/config\.json: expected 'architectures' to list the model class .*found \[\]",
    ),
    (
        "no-num-hidden-layers",
        _edit_config(lambda c: c.pop("num_hidden_layers")),
        r"/model/config\.json: expected 'num_hidden_layers' a positive integer, "
        r"found no 'num_hidden_layers' key",
    ),
    (
        "hidden-size-not-an-integer",
        _edit_config(lambda c: c.update(hidden_size="256")),
        r"/model/config\.json: expected 'hidden_size' a positive integer, found '256'",
    ),
]


@pytest.fixture
def model_copy(tiny_llama: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_llama, target)
    return target


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spoil", "expected"), [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES]
)
def test_a_bad_config_json_is_refused_before_prefect_starts(
    spoil: Callable[[Path], None],
    expected: str,
    model_copy: Path,
    dataset: Path,
    tmp_path: Path,
) -> None:
    spoil(model_copy)
    store = tmp_path / "store"
    result = extract(model_copy, dataset, store)
    assert_refused(result, expected)
    assert "Traceback" not in result.stdout + result.stderr
    assert "prefect" not in result.stdout.lower()  # refused before the flow (and its server)
    assert_nothing_written(store)


# --- settings and options: before Prefect, seconds --------------------------------------------

OPTION_CASES: list[tuple[str, list[str], dict[str, str], str]] = [
    (
        "negative-layer-id",
        ["--layer-ids=-1,4,8"],
        {},
        r"layer ids \[-1\]: expected 0\.\.8 for a model of 8 layers \(vLLM convention\), "
        r"found \[-1, 4, 8\]",
    ),
    (
        "duplicate-layer-ids",
        ["--layer-ids", "2,2,8"],
        {},
        r"capture\.layer_ids.*layer_ids: expected distinct ids, found \[2, 2, 8\]",
    ),
    (
        "specforge-id-below-zero",
        ["--layer-ids=-2,3", "--layer-convention", "specforge"],
        {},
        r"Layer ids \[-2\] \(specforge\) have no vllm equivalent",
    ),
    (
        "max-model-len-above-the-model",
        ["--max-model-len", "4096"],
        {},
        r"engine\.max_model_len: expected at most the model's limit 2048 "
        r"\(max_position_embeddings=2048 in .*\), found 4096",
    ),
    (
        "max-length-above-the-model",
        ["--max-length", "4096"],
        {},
        r"data\.max_length: expected below engine\.max_model_len 2048 .*found 4096",
    ),
    (
        "misspelt-env-var-key",
        [],
        {"HSX_ENGINE__MAX_MODEL_LENN": "2048"},
        r"unknown setting 'engine\.max_model_lenn' \(env HSX_ENGINE__MAX_MODEL_LENN\): "
        r"did you mean engine\.max_model_len\?",
    ),
    (
        "misspelt-env-var-section",
        [],
        {"HSX_ENGIN__DTYPE": "float32"},
        r"unknown setting variable HSX_ENGIN__DTYPE: did you mean HSX_ENGINE__DTYPE\?",
    ),
    (
        "misspelt-cli-option",
        ["--max-lenght", "512"],
        {},
        r"No such option: --max-lenght \(Possible options: --max-length,",
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("options", "env", "expected"), [c[1:] for c in OPTION_CASES], ids=[c[0] for c in OPTION_CASES]
)
def test_a_bad_setting_is_refused_naming_it(
    options: list[str],
    env: dict[str, str],
    expected: str,
    tiny_llama: Path,
    dataset: Path,
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    assert_refused(extract(tiny_llama, dataset, store, *options, env=env), expected)
    assert_nothing_written(store)


# --- over-length samples: not an error, truncated at planning ---------------------------------


@pytest.mark.timeout(120)
def test_an_over_length_sample_is_truncated_to_data_max_length(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A conversation longer than data.max_length is kept, cut to its first max_length tokens
    (settings: "Samples are truncated to this many tokens"); a short one is stored whole."""
    from hsx.data.tokenization import tokenize_conversation
    from hsx.extraction.steps import plan_and_create_store
    from hsx.plan.building import load_tokenizer
    from hsx.store.zarr_store import ExtractionStore
    from tests.conftest import make_settings

    long = {"messages": [{"role": "user", "content": "word " * 400}, GOOD["messages"][1]]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(long) + "\n")
    tokenizer = load_tokenizer(tiny_llama)
    full = [tokenize_conversation(tokenizer, c["messages"], 10_000) for c in (GOOD, long)]
    assert full[0].num_tokens < 64 < full[1].num_tokens  # the long one is over the limit below
    url = str(tmp_path / "store")
    plan_and_create_store(make_settings(tiny_llama, path, url, data={"max_length": 64}))
    store = ExtractionStore.open(url)
    _, lengths = store.sample_rows(0, 2)
    assert lengths.tolist() == [full[0].num_tokens, 64]
    assert store.committed_chunks() == {}


# --- the model folder beyond config.json: at the flow's preflight (a Prefect server) ----------


def _drop(*names: str) -> Callable[[Path], None]:
    def apply(model: Path) -> None:
        for name in names:
            (model / name).unlink()

    return apply


def _truncate(model: Path) -> None:
    shard = model / "model.safetensors"
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)


PREFLIGHT_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    (
        "unknown-architecture",
        _edit_config(lambda c: c.update(architectures=["LlamaForCasualLM"])),
        r"resolve: Architecture 'LlamaForCasualLM' is not in vLLM's model registry "
        r"\(\d+ architectures known\)\. Closest known: LlamaForCausalLM",
    ),
    (
        "missing-tokenizer",
        _drop("tokenizer.json", "tokenizer_config.json"),
        r"tokenizer: No tokenizer in .*/model: expected one of tokenizer\.json, "
        r"tokenizer_config\.json, tokenizer\.model, tiktoken\.model; found \[",
    ),
    (
        "missing-chat-template",
        _drop("chat_template.jinja"),
        r"tokenizer: Tokenizer \w+ has no chat template: expected 'chat_template' in "
        r".*/model/tokenizer_config\.json or .*/model/chat_template\.jinja; found neither",
    ),
    (
        "no-weights",
        _drop("model.safetensors"),
        r"weights: no weights in .*/model: expected \*\.safetensors shards .*found "
        r"chat_template\.jinja, config\.json",
    ),
    (
        "truncated-shard",
        _truncate,
        r"weights: 1 weight problem\(s\) in .*/model; first: model\.safetensors: truncated: "
        r"expected [\d,]+ bytes; found [\d,]+",
    ),
]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("spoil", "expected"), [c[1:] for c in PREFLIGHT_CASES], ids=[c[0] for c in PREFLIGHT_CASES]
)
def test_a_bad_model_folder_fails_preflight_before_the_model_load(
    spoil: Callable[[Path], None],
    expected: str,
    model_copy: Path,
    dataset: Path,
    tmp_path: Path,
) -> None:
    spoil(model_copy)
    store = tmp_path / "store"
    result = extract(model_copy, dataset, store)
    # The tokenizer, template and weight files are checked before Prefect starts; the
    # architecture by preflight's signature validation: both before the probe's engine.
    assert_refused(result, expected)
    assert "model-load probe" not in result.stdout
    assert_nothing_written(store)


# --- a store planned with other inputs: refused before Prefect -----------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("changed", ["layer_ids", "model"])
def test_resuming_a_store_planned_with_other_inputs_is_refused_naming_the_change(
    changed: str, tiny_llama: Path, tiny_deepseek: Path, dataset: Path, tmp_path: Path
) -> None:
    from hsx.extraction.steps import plan_and_create_store
    from hsx.model.config import read_config
    from hsx.plan.building import config_hash
    from settings import HsxSettings

    url = tmp_path / "store"
    first_model = tiny_deepseek if changed == "model" else tiny_llama
    plan_and_create_store(
        HsxSettings(
            model=first_model,
            dataset=dataset,
            store=str(url),
            engine={"max_model_len": 2048},
            data={"max_length": 2047},
            capture={"layer_ids": [2, 4, 8]},
        )
    )
    metadata = (url / "zarr.json").read_bytes()
    result = extract(
        tiny_llama,
        dataset,
        url,
        "--no-preflight",
        "--max-model-len",
        "2048",
        "--max-length",
        "2047",
        "--layer-ids",
        "1,4,8" if changed == "layer_ids" else "2,4,8",
    )
    if changed == "layer_ids":
        expected = r"layer_ids [^;]*: stored \[2, 4, 8\], this run \[1, 4, 8\]"
    else:
        stored, now = (config_hash(read_config(m)) for m in (tiny_deepseek, tiny_llama))
        expected = rf"model_config_hash [^;]*: stored '{stored}', this run '{now}'"
    assert result.returncode != 0, result.stdout[-3000:]
    text = said(result)
    assert "written with other inputs" in text and re.search(expected, text), text[-3000:]
    assert (url / "zarr.json").read_bytes() == metadata  # the store is left as it was
    assert not (url / "commits").exists() and not (url / "runs").exists()
