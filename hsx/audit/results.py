"""What an audit finds, as plain data: one ``ChunkAudit`` per work chunk (a Prefect task's
result), merged into the store's report. Every field is a number, a string or a list of them,
so a result pickles, and ``asdict`` gives the report's JSON."""

from __future__ import annotations

from dataclasses import dataclass, field

SHIFTS = (-1, 0, 1)  # the state at row t against the token at t + 1 + shift
# Position of a row within its sample: where a layer's norms are compared. Position 0 (the first
# token, often an attention sink with a far larger norm) stands alone.
POSITION_BUCKETS = (0, 1, 16, 128, 1024)  # bucket i: [edge i, edge i+1)
# Norm histograms: log10(norm) in NORM_BINS equal bins over [NORM_LOG_MIN, NORM_LOG_MAX), plus an
# underflow and an overflow bin at either end (all-zero vectors are counted apart).
NORM_LOG_MIN, NORM_LOG_MAX, NORM_BINS = -6.0, 6.0, 480


def bucket_name(bucket: int) -> str:
    """ "0", "1-15", ..., "1024+": the positions of POSITION_BUCKETS[bucket]."""
    low = POSITION_BUCKETS[bucket]
    high = POSITION_BUCKETS[bucket + 1] if bucket + 1 < len(POSITION_BUCKETS) else None
    if high is None:
        return f"{low}+"
    return str(low) if high == low + 1 else f"{low}-{high - 1}"


ERROR, WARNING, NOTE = "error", "warning", "note"


@dataclass
class Finding:
    """One thing the audit flags: what, where (chunk, samples, layer) and how bad."""

    severity: str  # error | warning | note
    kind: str  # e.g. "nan-vectors", "shifted", "greedy-disagreement", "post-norm"
    message: str
    chunks: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)


@dataclass
class Agreement:
    """Next-token agreement over a set of positions (the head's choice against the data's)."""

    positions: int = 0
    top1: int = 0
    top5: int = 0
    log_prob: float = 0.0  # summed: mean = log_prob / positions

    def add(self, other: Agreement) -> None:
        self.positions += other.positions
        self.top1 += other.top1
        self.top5 += other.top5
        self.log_prob += other.log_prob

    def rate(self, what: str = "top1") -> float | None:
        if not self.positions:
            return None
        value = self.log_prob if what == "log_prob" else getattr(self, what)
        return float(value) / self.positions


@dataclass
class Greediness:
    """The greedy check on loss-masked positions of regenerated greedy data."""

    positions: int = 0
    agree: int = 0
    ties: int = 0  # not the argmax, within the float tolerance of the store's dtype
    disagree: int = 0
    worst_margin: float = 0.0  # largest (top logit - data's logit) beyond tolerance

    def add(self, other: Greediness) -> None:
        self.positions += other.positions
        self.agree += other.agree
        self.ties += other.ties
        self.disagree += other.disagree
        self.worst_margin = max(self.worst_margin, other.worst_margin)


@dataclass
class SampleAudit:
    """One sample's figures (only samples whose rows were read)."""

    sample: int
    chunk: int
    tokens: int
    rows_read: int
    masked: Agreement = field(default_factory=Agreement)  # positions whose next token trains
    other: Agreement = field(default_factory=Agreement)
    shift_hits: list[int] = field(default_factory=lambda: [0, 0, 0])  # top-1 at SHIFTS
    shift_positions: int = 0
    greedy: Greediness = field(default_factory=Greediness)


@dataclass
class LayerStats:
    """One captured layer over the rows read (of a chunk, or merged over the store)."""

    layer_id: int
    vectors: int = 0
    nan: int = 0
    inf: int = 0
    zero: int = 0
    constant: int = 0  # every element equal, not zero
    repeated: int = 0  # equal to the vector before it in its sample
    # [bucket][bin]: log10-norm histogram by position bucket (see NORM_BINS)
    norm_histogram: list[list[int]] = field(default_factory=list)
    scale_min: float | None = None  # fp8 stores: smallest and largest positive finite scale
    scale_max: float | None = None

    def add(self, other: LayerStats) -> None:
        for name in ("vectors", "nan", "inf", "zero", "constant", "repeated"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if not self.norm_histogram:
            self.norm_histogram = [list(row) for row in other.norm_histogram]
        elif other.norm_histogram:
            for mine, theirs in zip(self.norm_histogram, other.norm_histogram, strict=True):
                for i, count in enumerate(theirs):
                    mine[i] += count
        for name, pick in (("scale_min", min), ("scale_max", max)):
            values = [v for v in (getattr(self, name), getattr(other, name)) if v is not None]
            setattr(self, name, pick(values) if values else None)


@dataclass
class ChunkAudit:
    """Everything the audit learned from one work chunk."""

    chunk: int
    samples: int  # usable samples of the chunk in range
    tokens: int
    rows_read: int
    masked: Agreement = field(default_factory=Agreement)
    other: Agreement = field(default_factory=Agreement)
    shift_hits: list[int] = field(default_factory=lambda: [0, 0, 0])
    shift_positions: int = 0
    greedy: Greediness = field(default_factory=Greediness)
    layers: list[LayerStats] = field(default_factory=list)
    post_norm_vectors: int = 0  # final-layer vectors that look post-norm (see head.py)
    sample_audits: list[SampleAudit] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    # Agreement of the final state with its next token by position bucket: [bucket] -> counts
    by_position: list[Agreement] = field(
        default_factory=lambda: [Agreement() for _ in POSITION_BUCKETS]
    )
    seconds: float = 0.0
