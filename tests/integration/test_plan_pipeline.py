"""Planning on a real tokenizer and store, without an engine."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from hsx.data.tokenization import iter_conversations, tokenize_conversation
from hsx.extraction.steps import plan_and_create_store
from hsx.plan.building import load_tokenizer
from hsx.store.reader import HiddenStatesReader
from hsx.store.zarr_store import ExtractionStore
from tests.conftest import make_settings

pytestmark = pytest.mark.timeout(300)


def spool_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("hsx-tokens-*"))


def test_plan_writes_tokens_and_leaves_no_spool(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    before = spool_dirs()
    url = str(tmp_path / "plan.zarr")
    summary = plan_and_create_store(
        make_settings(tiny_llama, sample_dataset, url, data={"max_samples": 20})
    )
    assert spool_dirs() == before  # the temporary token spool is deleted once the store exists
    assert summary.samples == 20 and summary.pending == list(range(summary.chunks))
    store = ExtractionStore.open(url)
    tokenizer = load_tokenizer(tiny_llama)
    starts, lengths = store.sample_rows(0, 20)
    for conversation, start, length in zip(
        iter_conversations(sample_dataset), starts, lengths, strict=False
    ):
        expected = tokenize_conversation(tokenizer, conversation.messages, 2048)
        assert np.array_equal(
            store.read_rows("input_ids", int(start), int(start + length)), expected.input_ids
        )
        assert np.array_equal(
            store.read_rows("loss_mask", int(start), int(start + length)), expected.loss_mask
        )
    assert len(HiddenStatesReader(url)) == 0  # planned, nothing committed: nothing readable
    # A second plan of the same inputs opens the same store; spool deleted again.
    again = plan_and_create_store(
        make_settings(tiny_llama, sample_dataset, url, data={"max_samples": 20})
    )
    assert again.plan_hash == summary.plan_hash and spool_dirs() == before
