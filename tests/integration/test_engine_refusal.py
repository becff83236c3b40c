"""A prompt the real engine refuses (longer than its max_model_len) fails its work chunk alone,
with a fatal RequestRefusedError naming the request and vLLM's own reason; the engine stays up,
the run's engine queue gives the chunk's tokens back, and the next chunk commits through
the same engine. (Settings refuse such a plan before any load; a plan written by another hsx, or
a model whose limit shrank, is what this guards.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hsx.errors import RequestRefusedError
from hsx.extraction.chunk_extraction import RunContext, extract_chunk
from hsx.extraction.host_pipeline import HostPipeline
from hsx.plan.chunks import Plan, cut_chunks
from hsx.plan.token_spool import TokenSpool
from hsx.store.verify import verify_store
from hsx.store.zarr_store import ExtractionStore
from tests.conftest import make_settings

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]

LENGTHS = [200, 300, 3000, 250, 180]  # sample 2 is over the engine's max_model_len of 2048


def _plan() -> Plan:
    lengths = np.asarray(LENGTHS, dtype=np.int32)
    chunks, starts, rows = cut_chunks(
        lengths, np.arange(len(LENGTHS)) * 10, np.arange(len(LENGTHS)) + 1, 256, 512
    )
    spool = TokenSpool()
    rng = np.random.default_rng(0)
    for length in LENGTHS:
        ids = rng.integers(1, 2000, size=length, dtype=np.int32)  # the tiny vocabulary: 2048
        spool.append(ids, (np.arange(length) % 2).astype(np.uint8))
    inputs = {"test": "engine refusal", "rows_per_chunk": 256, "work_chunk_tokens": 512}
    return Plan(inputs, lengths, starts, chunks, rows, 256, tokens=spool)


def test_a_prompt_the_engine_refuses_fails_its_chunk_alone(
    host: HostPipeline, tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    from hsx.engine.vllm_engine import get_engine
    from hsx.extraction.run import run_spec

    settings = make_settings(tiny_llama, sample_dataset, str(tmp_path / "unused.zarr"))
    spec = run_spec(settings)
    engine = get_engine(spec.settings.model, spec.settings.engine, spec.layer_ids)
    plan = _plan()
    meta = {
        "num_layers_captured": len(spec.layer_ids),
        "hidden_size": 256,
        "logical_dtype": "float32",
        "layer_ids": list(spec.layer_ids),
    }
    store = ExtractionStore.open_or_create(str(tmp_path / "refusal.zarr"), plan, meta)
    refused_chunk = next(c for c in plan.chunks if c.sample_start <= 2 < c.sample_end)
    with pytest.raises(RequestRefusedError) as refused:
        extract_chunk(host, store, refused_chunk, engine, 4096, RunContext("r"))
    message = str(refused.value)
    assert "of 3000 tokens: expected vLLM to accept it, found" in message, message
    assert "2048" in message, message  # vLLM's reason names the limit
    assert not refused.value.retryable
    assert host.engine_queue.queued == 0  # the chunk's tokens were given back
    assert store.committed_chunks() == {}

    # The same engine object serves the other chunks: nothing was rebuilt.
    for chunk in plan.chunks:
        if chunk.index != refused_chunk.index:
            extract_chunk(host, store, chunk, engine, 4096, RunContext("r"))
    again = get_engine(spec.settings.model, spec.settings.engine, spec.layer_ids)
    assert again is engine
    committed = sorted(store.committed_chunks())
    assert committed == [c.index for c in plan.chunks if c.index != refused_chunk.index]
    report = verify_store(store)
    assert report.missing == [refused_chunk.index] and report.chunks_verified == len(committed)
    assert host.engine_queue.queued == 0
