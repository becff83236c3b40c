"""The datasets users already have: one conversation set written in every form hsx reads plans to
the same token ids and loss masks (a real tokenizer, real Parquet and save_to_disk files, the
planner and store); a tool-calling conversation tokenizes as the tokenizer's own template
renders it; the over-length policy and ids, as the store records them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hsx.data.tokenization import iter_conversations, tokenize_conversation
from hsx.errors import DatasetError
from hsx.extraction.steps import plan_and_create_store
from hsx.plan.building import load_tokenizer
from hsx.store.zarr_store import ExtractionStore
from tests.conftest import make_settings

pytestmark = pytest.mark.timeout(300)
SAMPLES = 24


def _rows(sample_dataset: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in sample_dataset.read_text().splitlines()[:SAMPLES]]


def _sharegpt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]


def _write_forms(rows: list[dict[str, Any]], folder: Path, tokenized: list[Any]) -> dict[str, Path]:
    """The same conversations as messages JSONL, `conversations` role/content, ShareGPT, a JSON
    array, Parquet, a save_to_disk folder, and pre-tokenized rows (hsx's own tokenization)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    def jsonl(name: str, records: list[dict[str, Any]], bom: bool = False) -> Path:
        path = folder / name
        text = "".join(json.dumps(r) + "\n" for r in records)
        path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
        return path

    forms = {
        "messages jsonl (with a byte-order mark)": jsonl("messages.jsonl", rows, bom=True),
        "conversations role/content": jsonl(
            "conversations.jsonl",
            [{"id": r["id"], "conversations": r["messages"]} for r in rows],
        ),
        "sharegpt from/value": jsonl(
            "sharegpt.jsonl",
            [{"conversation_id": r["id"], "conversations": _sharegpt(r["messages"])} for r in rows],
        ),
    }
    array = folder / "array.json"
    array.write_text(json.dumps(rows))
    forms["json array"] = array
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, folder / "rows.parquet", row_group_size=7)  # several row groups
    forms["parquet"] = folder / "rows.parquet"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder / "saved"))
    forms["save_to_disk"] = folder / "saved"
    forms["pre-tokenized"] = jsonl(
        "tokens.jsonl",
        [
            {"id": r["id"], "input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.tolist()}
            for r, s in zip(rows, tokenized, strict=True)
        ],
    )
    return forms


def _store_tokens(url: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    store = ExtractionStore.open(url)
    lengths = np.asarray(store.array("sample_lengths")[:])
    rows = int(store.meta["total_rows"])
    return lengths, store.read_rows("input_ids", 0, rows), store.read_rows("loss_mask", 0, rows)


def test_every_form_plans_the_same_tokens(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    rows = _rows(sample_dataset)
    tokenizer = load_tokenizer(tiny_llama)
    tokenized = [tokenize_conversation(tokenizer, r["messages"], 2047) for r in rows]
    forms = _write_forms(rows, tmp_path, tokenized)
    found = {}
    for name, path in forms.items():
        url = str(tmp_path / f"{path.stem}.zarr")
        summary = plan_and_create_store(make_settings(tiny_llama, path, url))
        assert summary.samples == SAMPLES, name
        found[name] = _store_tokens(url)
    reference = found.pop("messages jsonl (with a byte-order mark)")
    assert np.array_equal(reference[0], [s.num_tokens for s in tokenized])
    for name, (lengths, ids, mask) in found.items():
        assert np.array_equal(lengths, reference[0]), name
        assert np.array_equal(ids, reference[1]) and np.array_equal(mask, reference[2]), name
    # ShareGPT's ids come from conversation_id; the JSON array's and Parquet's from id.
    assert [c.sample_id for c in iter_conversations(forms["sharegpt from/value"])][:2] == [
        r["id"] for r in rows[:2]
    ]
    # A glob of several files reads them in order, as one dataset; an id in two files is
    # refused naming both rows.
    parts = tmp_path / "parts"
    parts.mkdir()
    for number, half in enumerate((rows[: SAMPLES // 2], rows[SAMPLES // 2 :])):
        (parts / f"part-{number}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in half))
    url = str(tmp_path / "glob.zarr")
    assert plan_and_create_store(make_settings(tiny_llama, parts / "part-*.jsonl", url)).samples
    assert np.array_equal(_store_tokens(url)[1], reference[1])
    twice = tmp_path / "[ms][eh]*.jsonl"  # messages.jsonl and sharegpt.jsonl: the same ids
    with pytest.raises(DatasetError, match=r"sharegpt.jsonl:1: expected each id once, found id"):
        plan_and_create_store(make_settings(tiny_llama, twice, str(tmp_path / "twice.zarr")))


TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>"
    "{{ call.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_tool_call_is_tokenized_as_the_template_renders_it(tiny_llama: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama)
    tokenizer.chat_template = TOOL_TEMPLATE
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    sample = tokenize_conversation(tokenizer, messages, 2047, tools=tools)
    expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert "Tools: " in expected and "<tool_call>" in expected
    ids = tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert sample.input_ids.tolist() == ids
    masked = tokenizer.decode(sample.input_ids[sample.loss_mask == 1])
    assert '<tool_call>{"name": "weather"' in masked.replace("'", '"')
    assert "It is sunny." in masked and "Oslo?" not in masked and "sunny<" not in masked


def test_overlength_samples_are_truncated_skipped_or_refused_and_recorded(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    path = tmp_path / "some.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(sample_dataset)))
    tokenizer = load_tokenizer(tiny_llama)
    lengths = [
        tokenize_conversation(tokenizer, c.messages, 4096).num_tokens
        for c in iter_conversations(path)
    ]
    limit = sorted(lengths)[len(lengths) // 2]  # about half are longer
    longer = [i for i, n in enumerate(lengths) if n > limit]
    truncated_url = str(tmp_path / "truncated.zarr")
    truncated = plan_and_create_store(
        make_settings(tiny_llama, path, truncated_url, data={"max_length": limit})
    )
    assert truncated.samples_truncated == len(longer) and truncated.samples_left_out == 0
    record = ExtractionStore.open(truncated_url).meta["overlength"]
    assert record["policy"] == "truncate" and record["skipped"] == []
    assert record["truncated"] == [[i, lengths[i]] for i in longer]
    skipped_url = str(tmp_path / "skipped.zarr")
    data = {"max_length": limit, "on_overlength": "skip"}
    summary = plan_and_create_store(make_settings(tiny_llama, path, skipped_url, data=data))
    assert summary.samples == SAMPLES - len(longer) == SAMPLES - summary.samples_left_out
    skipped = ExtractionStore.open(skipped_url).meta["overlength"]["skipped"]
    assert skipped == [[f"{path}:{i + 1}", lengths[i]] for i in longer]
    data = {"max_length": limit, "on_overlength": "fail"}
    with pytest.raises(DatasetError, match=rf"{path}:{longer[0] + 1}: expected at most {limit}"):
        plan_and_create_store(make_settings(tiny_llama, path, str(tmp_path / "f.zarr"), data=data))
    assert not (tmp_path / "f.zarr").exists()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_parquet_dataset_extracts_the_same_states_as_its_jsonl(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """Through the real engine: the store of the Parquet form equals the JSONL form's, state
    for state (fp32), apart from provenance."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hsx.extraction.chunk_extraction import RunContext
    from hsx.extraction.run import extract_work_chunk
    from hsx.store.reader import HiddenStatesReader

    rows = _rows(sample_dataset)[:12]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=5)
    readers = []
    for path in (jsonl, tmp_path / "rows.parquet"):
        settings = make_settings(
            tiny_llama,
            path,
            str(tmp_path / f"{path.suffix[1:]}.zarr"),
            layout={"rows_per_chunk": 64},
        )
        for index in plan_and_create_store(settings).pending:
            extract_work_chunk(settings, index, RunContext("formats"))
        readers.append(HiddenStatesReader(settings.store))
    assert len(readers[0]) == len(readers[1]) == 12
    for index in range(12):
        first, second = readers[0].sample(index), readers[1].sample(index)
        assert np.array_equal(first.input_ids.numpy(), second.input_ids.numpy())
        assert torch.equal(first.hidden_states, second.hidden_states), index
