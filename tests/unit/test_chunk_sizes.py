"""Work chunks smaller than storage chunks: each work chunk is padded to whole storage chunks, so
225 work chunks of 512 tokens in the tiny model's automatic 8,192-row (16 MiB) objects wrote
3.6 GB for 103k tokens without a word. Planning now sizes the automatic C to the work chunks
(and logs it); both set by hand that way is refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hsx.plan.chunks import storage_rows_for_work_chunks
from settings import HsxSettings

pytestmark = pytest.mark.timeout(60)


def test_the_automatic_storage_chunk_fits_a_smaller_work_chunk() -> None:
    assert storage_rows_for_work_chunks(8192, 512) == 512
    assert storage_rows_for_work_chunks(8192, 1000) == 512  # a power of two, not above it
    assert storage_rows_for_work_chunks(8192, 20) == 16  # the settings' least C
    assert storage_rows_for_work_chunks(8192, None) == 8192  # automatic work chunks fit C
    assert storage_rows_for_work_chunks(256, 4096) == 256  # larger work chunks keep C


def test_work_chunks_below_a_chosen_storage_chunk_are_refused_naming_both() -> None:
    with pytest.raises(ValidationError) as refused:
        HsxSettings(
            model="/models/m",
            dataset="/data/d.jsonl",
            store="memory://s",
            layout={"rows_per_chunk": 256, "work_chunk_tokens": 100},
        )
    message = str(refused.value)
    assert "layout.work_chunk_tokens: expected at least layout.rows_per_chunk (256" in message
    assert "found 100" in message
    fits = HsxSettings(
        model="/models/m",
        dataset="/data/d.jsonl",
        store="memory://s",
        layout={"rows_per_chunk": 256, "work_chunk_tokens": 256},
    )
    assert fits.layout.work_chunk_tokens == 256
