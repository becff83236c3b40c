"""The shape of a store's data, from its token arrays alone (5 bytes a row, no state read): sample
lengths, loss-mask coverage, the draft vocabulary `hsx vocab` would keep and how much of the
trained tokens it covers, tokens per chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hsx.audit.scope import ChunkScope
from hsx.store.reader import HiddenStatesReader
from hsx.trainers.vocab import draft_vocab, token_rows

# Length histogram edges (tokens): powers of two from 1 to 2**20.
LENGTH_EDGES = [0] + [2**i for i in range(21)]
COVERAGE_EDGES = [i / 10 for i in range(11)]  # per-sample loss-mask coverage, tenths
_TOP_TOKENS = 20


@dataclass
class DataShape:
    samples: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    samples_without_masked_tokens: int = 0
    length_percentiles: dict[str, int] = field(default_factory=dict)  # p1, p50, p99, max
    length_histogram: list[int] = field(default_factory=list)  # counts over LENGTH_EDGES
    coverage_histogram: list[int] = field(default_factory=list)  # over COVERAGE_EDGES
    vocab_size: int = 0
    distinct_masked_tokens: int = 0
    draft_vocab_size: int = 0
    draft_vocab_coverage: float = 0.0  # of the masked tokens, by the draft vocabulary
    # (draft vocabulary size, coverage) at a few sizes, for the coverage curve
    coverage_curve: list[tuple[int, float]] = field(default_factory=list)
    top_tokens: list[tuple[int, int]] = field(default_factory=list)  # (id, count)
    # chunk -> (samples, tokens, masked tokens)
    per_chunk: dict[int, tuple[int, int, int]] = field(default_factory=dict)


def data_shape(
    reader: HiddenStatesReader, scopes: list[ChunkScope], vocab_size: int, draft_vocab_size: int
) -> DataShape:
    """Over every usable sample of ``scopes`` (all the chunks in range, audited or not)."""
    shape = DataShape(vocab_size=vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    lengths: list[int] = []
    coverage: list[float] = []
    chunk_of = {s: scope.chunk for scope in scopes for s in scope.samples}
    per_chunk: dict[int, list[int]] = {}
    for sample, ids, mask in token_rows(reader, sorted(chunk_of)):
        trained = ids[mask.astype(bool)]
        trained = trained[(trained >= 0) & (trained < vocab_size)]
        counts += np.bincount(trained, minlength=vocab_size)
        lengths.append(int(ids.size))
        masked = int(mask.sum())
        coverage.append(masked / max(int(ids.size), 1))
        totals = per_chunk.setdefault(chunk_of[sample], [0, 0, 0])
        totals[0] += 1
        totals[1] += int(ids.size)
        totals[2] += masked
    shape.samples = len(lengths)
    shape.tokens = int(sum(lengths))
    shape.masked_tokens = int(counts.sum())
    shape.samples_without_masked_tokens = sum(1 for c in coverage if c == 0)
    if lengths:
        values = np.asarray(lengths)
        shape.length_percentiles = {
            name: int(np.percentile(values, q)) for name, q in (("p1", 1), ("p50", 50), ("p99", 99))
        } | {"max": int(values.max())}
        shape.length_histogram = np.histogram(values, LENGTH_EDGES)[0].tolist()
        shape.coverage_histogram = np.histogram(coverage, COVERAGE_EDGES)[0].tolist()
    shape.per_chunk = {c: (t[0], t[1], t[2]) for c, t in sorted(per_chunk.items())}
    _vocabulary(shape, counts, draft_vocab_size)
    return shape


def _vocabulary(shape: DataShape, counts: np.ndarray, draft_vocab_size: int) -> None:
    """The draft vocabulary of the N most frequent trained ids (as `hsx vocab` builds it)."""
    total = int(counts.sum())
    shape.distinct_masked_tokens = int(np.count_nonzero(counts))
    size = min(draft_vocab_size, counts.size)
    shape.draft_vocab_size = size
    if not total or not size:
        return
    _, t2d = draft_vocab(counts, size)
    shape.draft_vocab_coverage = float(counts[t2d.numpy()].sum()) / total
    ordered = np.sort(counts)[::-1].cumsum() / total
    sizes = sorted({min(n, counts.size) for n in (2**i for i in range(4, 20))} | {size})
    shape.coverage_curve = [(n, float(ordered[n - 1])) for n in sizes]
    top = np.lexsort((np.arange(counts.size), -counts))[:_TOP_TOKENS]
    shape.top_tokens = [(int(i), int(counts[i])) for i in top if counts[i]]
