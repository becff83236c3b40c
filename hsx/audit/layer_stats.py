"""Statistics of each captured layer over the rows read: NaN, inf, all-zero and constant vectors,
vectors equal to the one before them, norms by position (log histograms, mergeable over
chunks), fp8 scales; and what they flag, named by chunk, sample and layer: a capture shorter
than its tokens (a sample's last rows zero in every layer), a final state the norm was applied
to, norm outliers."""

from __future__ import annotations

import numpy as np
import torch

from hsx.audit.results import (
    ERROR,
    NORM_BINS,
    NORM_LOG_MAX,
    NORM_LOG_MIN,
    POSITION_BUCKETS,
    WARNING,
    ChunkAudit,
    Finding,
    LayerStats,
)
from hsx.audit.scope import Window

# A final-layer vector is "post-norm" when RMS(state / norm weight) is 1 within this, by the
# stored dtype's rounding (fp8: 2**-4 of each element at worst).
POST_NORM_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-2, "fp8_e4m3": 5e-2}
# A chunk whose final-layer vectors are that to this fraction was stored post-norm.
POST_NORM_FRACTION = 0.99
# A norm this many times its layer's median at the same position bucket (or that many times
# below it) in the chunk is an outlier (a warning: massive activations exist).
OUTLIER_FACTOR = 100.0
_LISTED = 5  # occurrences named in a finding's message


def empty_layers(layer_ids: list[int]) -> list[LayerStats]:
    width = NORM_BINS + 2
    return [
        LayerStats(i, norm_histogram=[[0] * width for _ in POSITION_BUCKETS]) for i in layer_ids
    ]


def _bins(norms: torch.Tensor) -> torch.Tensor:
    """[n] norms > 0 -> [n] histogram bins (0: underflow, NORM_BINS + 1: overflow)."""
    scaled = (norms.log10() - NORM_LOG_MIN) / (NORM_LOG_MAX - NORM_LOG_MIN) * NORM_BINS
    return (scaled.floor().clamp(-1, NORM_BINS) + 1).long()


class LayerScan:
    """The statistics of one chunk's rows, window by window, and the occurrences to name."""

    def __init__(self, audit: ChunkAudit, layer_ids: list[int], ids: np.ndarray, first_row: int):
        self.audit = audit
        self.layer_ids = layer_ids
        self.ids = ids  # the chunk's token rows from first_row
        self.first_row = first_row
        audit.layers = empty_layers(layer_ids)
        # [K, buckets, bins]: merged into audit.layers by finish()
        self.histogram = np.zeros((len(layer_ids), len(POSITION_BUCKETS), NORM_BINS + 2), np.int64)
        # kind -> layer slot -> [(sample, position)]: where each problem was seen
        self.seen: dict[str, dict[int, list[tuple[int, int]]]] = {}
        # (samples [R], norms [R, K], position buckets [R], positions in the sample [R])
        self.norms: list[tuple[np.ndarray, torch.Tensor, np.ndarray, np.ndarray]] = []
        self.short: list[tuple[int, int, int]] = []  # (sample, rows covered, tokens)
        self.tail_rows = 0  # of the group being added

    def add(
        self, windows: list[Window], states: list[torch.Tensor], scales: list[torch.Tensor | None]
    ) -> None:
        """A group of windows: per window ``states [w, K, H]`` float32 and, for fp8 stores,
        ``scales [w, K]``; checked together (one pass of each check over the group)."""
        x = torch.cat(states)  # [R, K, H]
        sizes = [s.shape[0] for s in states]
        sample = np.repeat([w.sample for w in windows], sizes)  # [R]
        offsets = np.concatenate(
            [np.arange(w.row_start, w.row_end) - w.sample_start for w in windows]
        )  # [R] position within the sample
        norms = x.norm(dim=-1)  # [R, K]: NaN where a NaN is, inf where an inf is (no NaN)
        zero = norms == 0
        zero[zero.clone()] = (x[zero] == 0).all(dim=-1)  # not tiny values squared to 0
        checks = {
            "nan": torch.isnan(norms),
            "inf": torch.isinf(norms),
            "zero": zero & ~self._short_tails(windows, zero, sizes),
            "constant": (x == x[..., :1]).all(dim=-1) & ~zero,
            "repeated": self._repeated(windows, x, zero, sizes),
        }
        buckets = np.searchsorted(np.asarray(POSITION_BUCKETS), offsets, side="right") - 1
        self.norms.append((sample, norms, buckets, offsets))
        usable = (torch.isfinite(norms) & (norms > 0)).numpy()  # [R, K]
        for slot, stats in enumerate(self.audit.layers):
            stats.vectors += x.shape[0]
            for kind, check in checks.items():
                rows = check[:, slot].nonzero()[:, 0].numpy()
                setattr(stats, kind, getattr(stats, kind) + rows.size)
                if rows.size:
                    where = self.seen.setdefault(kind, {}).setdefault(slot, [])
                    where += zip(sample[rows].tolist(), offsets[rows].tolist(), strict=True)
            bins = _bins(norms[usable[:, slot], slot]).numpy()
            np.add.at(self.histogram[slot], (buckets[usable[:, slot]], bins), 1)
            stats.zero += self.tail_rows  # a short capture's rows: zero, named apart
        self.tail_rows = 0
        for window_scales in scales:
            if window_scales is not None:
                self._scales(window_scales)

    def _scales(self, scales: torch.Tensor) -> None:
        """fp8 stores: the range of positive finite scales of each layer ``[w, K]``."""
        for slot, stats in enumerate(self.audit.layers):
            column = scales[:, slot]
            usable = column[torch.isfinite(column) & (column > 0)]
            if usable.numel():
                low, high = float(usable.min()), float(usable.max())
                stats.scale_min = low if stats.scale_min is None else min(stats.scale_min, low)
                stats.scale_max = high if stats.scale_max is None else max(stats.scale_max, high)

    def _short_tails(
        self, windows: list[Window], zero: torch.Tensor, sizes: list[int]
    ) -> torch.Tensor:
        """[R, 1] rows at a sample's end that are zero in every layer (a capture shorter than
        its tokens: a prefix cache hit, a lost tail): named as such, not as zero vectors."""
        every = zero.all(dim=1)  # [R]
        tails = torch.zeros_like(every)
        first = 0
        for window, size in zip(windows, sizes, strict=True):
            rows = every[first : first + size]
            if window.row_end == window.sample_end and size and bool(rows[-1]):
                tail = int(rows.flip(0).int().cumprod(0).sum())
                tails[first + size - tail : first + size] = True
                tokens = window.sample_end - window.sample_start
                self.short.append((window.sample, tokens - tail, tokens))
                self.tail_rows += tail
            first += size
        return tails[:, None]

    def _repeated(
        self, windows: list[Window], x: torch.Tensor, zero: torch.Tensor, sizes: list[int]
    ) -> torch.Tensor:
        """[R, K] vectors equal to the one before them in their sample (zero vectors are
        counted as such): never two positions of a sequence, except the embeddings (id 0) of
        a repeated token."""
        same = torch.zeros(zero.shape, dtype=torch.bool)
        if x.shape[0] > 1:
            same[1:] = (x[1:] == x[:-1]).all(dim=-1) & ~zero[1:]
        starts = np.cumsum([0, *sizes[:-1]])
        same[torch.from_numpy(starts)] = False  # a window's first row has none before it
        if 0 in self.layer_ids:
            rows = np.concatenate([np.arange(w.row_start, w.row_end) for w in windows])
            ids = torch.from_numpy(self.ids[rows - self.first_row])
            repeat = torch.zeros(ids.shape, dtype=torch.bool)
            repeat[1:] = ids[1:] == ids[:-1]
            same[:, self.layer_ids.index(0)] &= ~repeat
        return same

    def finish(self) -> list[Finding]:
        """The histograms into the chunk's layers; what the scan flags in this chunk."""
        for slot, stats in enumerate(self.audit.layers):
            stats.norm_histogram = self.histogram[slot].tolist()
        chunk = self.audit.chunk
        found = []
        for sample, covered, tokens in self.short:
            found.append(
                Finding(
                    ERROR,
                    "rows-short",
                    f"chunk {chunk}, sample {sample}: states cover {covered} of its {tokens} "
                    f"tokens (expected a state for every token; its last {tokens - covered} rows "
                    "are zero in every layer: a capture shorter than its prompt)",
                    [chunk],
                    [sample],
                )
            )
        what = {
            "nan": "NaN vectors",
            "inf": "vectors with inf",
            "zero": "all-zero vectors",
            "constant": "constant vectors (every element equal)",
            "repeated": "vectors equal to the one before them (stale or repeated rows)",
        }
        for kind, by_slot in self.seen.items():
            for slot, where in sorted(by_slot.items()):
                stats = self.audit.layers[slot]
                samples = sorted({s for s, _ in where})
                listed = ", ".join(f"sample {s} position {p}" for s, p in where[:_LISTED])
                more = f" and {len(where) - _LISTED} more" if len(where) > _LISTED else ""
                found.append(
                    Finding(
                        ERROR,
                        f"{kind}-vectors",
                        f"chunk {chunk}, layer id {stats.layer_id}: {len(where)} of "
                        f"{stats.vectors} {what[kind]} (expected none): {listed}{more}",
                        [chunk],
                        samples[:1000],
                    )
                )
        return found + self._outliers()

    def _outliers(self) -> list[Finding]:
        if not self.norms:
            return []
        norms = torch.cat([n for _, n, _, _ in self.norms])  # [rows, K]
        buckets = np.concatenate([b for _, _, b, _ in self.norms])
        samples = np.concatenate([s for s, _, _, _ in self.norms])
        offsets = np.concatenate([o for _, _, _, o in self.norms])
        found = []
        for slot, stats in enumerate(self.audit.layers):
            where: list[str] = []
            hit_samples: set[int] = set()
            for bucket in np.unique(buckets):
                inside = np.flatnonzero(buckets == bucket)
                values = norms[inside, slot]
                usable = values[torch.isfinite(values) & (values > 0)]
                if usable.numel() < 8:
                    continue
                median = float(usable.median())
                ratio = values / median  # zero and NaN vectors are named as such, not here
                odd = inside[
                    (
                        (ratio > OUTLIER_FACTOR) | ((ratio < 1 / OUTLIER_FACTOR) & (ratio > 0))
                    ).numpy()
                ]
                for i in odd.tolist():
                    hit_samples.add(int(samples[i]))
                    where.append(
                        f"sample {samples[i]} row {offsets[i]} ({float(norms[i, slot]):.3g} vs median {median:.3g})"
                    )
            if where:
                found.append(
                    Finding(
                        WARNING,
                        "norm-outliers",
                        f"chunk {self.audit.chunk}, layer id {stats.layer_id}: {len(where)} "
                        f"vectors with a norm over {OUTLIER_FACTOR:g}x from their position's "
                        f"median: {', '.join(where[:_LISTED])}",
                        [self.audit.chunk],
                        sorted(hit_samples)[:1000],
                    )
                )
        return found


def post_norm_finding(
    audit: ChunkAudit, layer_id: int, tolerance: float, samples: list[int]
) -> Finding | None:
    """The chunk's final captured layer stored after the final norm (see head.post_norm_ratio)."""
    vectors = audit.layers[-1].vectors if audit.layers else 0
    if not vectors or audit.post_norm_vectors < POST_NORM_FRACTION * vectors:
        return None
    return Finding(
        ERROR,
        "post-norm",
        f"chunk {audit.chunk}: the final captured layer (id {layer_id}) looks post-norm: RMS of "
        f"state / norm weight is 1 within {tolerance:g} for {audit.post_norm_vectors} of its "
        f"{vectors} vectors (expected the pre-norm residual stream, vLLM's id {layer_id}: the "
        "final norm was applied to the stored state; a trainer would apply it twice)",
        [audit.chunk],
        sorted(samples)[:1000],
    )
