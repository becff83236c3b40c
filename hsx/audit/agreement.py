"""Next-token agreement of one chunk: the final captured layer through the target's own norm and
head against the data's tokens, at shifts -1, 0 and +1 (alignment), split by loss mask, per
sample; on greedy regenerated data, the exact check of every trained position, and what a
failure looks like (another sample's states, another layer's).

A position t is *loss-masked* when its next token t+1 is (the token a draft learns to predict
from the state at t).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hsx.audit.head import OutputHead
from hsx.audit.results import (
    ERROR,
    POSITION_BUCKETS,
    SHIFTS,
    Agreement,
    ChunkAudit,
    Finding,
    Greediness,
)
from hsx.audit.scope import Window

# An alignment verdict needs a shift whose top-1 rate is at least this, and this many times the
# rate of every other shift: the data's own repeats (template tokens) never reach it by chance.
MIN_DECISIVE_RATE = 0.1
MIN_DECISIVE_RATIO = 2.0
MIN_DECISIVE_POSITIONS = 16
# A greedy failure is put down to another layer or another sample when that one agrees so.
_DIAGNOSIS_RATE = 0.9
_MAX_CANDIDATES = 256  # samples of a chunk whose tokens a failing sample's states are tried on


@dataclass
class Positions:
    """The positions of one chunk whose next token is scored (flat, in window order)."""

    rows: np.ndarray  # [n] absolute row of the state
    samples: np.ndarray  # [n] sample index
    offsets: np.ndarray  # [n] position within the sample
    ends: np.ndarray  # [n] position counted from the sample's end (-1: its last row)
    targets: torch.Tensor  # [n, 3] int64: token at row + 1 + shift, -1 outside the sample
    masked: np.ndarray  # [n] bool: the next token is loss-masked
    states: torch.Tensor  # [n, K, H] float32


def gather_positions(
    windows: list[Window],
    states: list[torch.Tensor],
    ids: np.ndarray,
    mask: np.ndarray,
    first_row: int,
) -> Positions:
    """``states``: per window ``[rows, K, H]`` float32; ``ids``/``mask``: the chunk's token rows
    from ``first_row``."""
    rows, samples, offsets, ends, picked = [], [], [], [], []
    for window, window_states in zip(windows, states, strict=True):
        last = min(window.row_end, window.sample_end - 1)  # a next token exists
        here = np.arange(window.row_start, last, dtype=np.int64)
        rows.append(here)
        samples.append(np.full(here.size, window.sample, dtype=np.int64))
        offsets.append(here - window.sample_start)
        ends.append(here - window.sample_end)
        picked.append(window_states[: here.size])
    if not rows:
        empty = np.empty(0, np.int64)
        no_targets = torch.empty((0, len(SHIFTS)), dtype=torch.int64)
        return Positions(empty, empty, empty, empty, no_targets, np.empty(0, bool), torch.empty(0))
    row = np.concatenate(rows)
    sample_end = np.concatenate(
        [np.full(r.size, w.sample_end, np.int64) for r, w in zip(rows, windows, strict=True)]
    )
    sample_start = row - np.concatenate(offsets)
    targets = np.full((row.size, len(SHIFTS)), -1, dtype=np.int64)
    for column, shift in enumerate(SHIFTS):
        wanted = row + 1 + shift
        inside = (wanted >= sample_start) & (wanted < sample_end)
        targets[inside, column] = ids[wanted[inside] - first_row]
    masked = mask[row + 1 - first_row].astype(bool)
    return Positions(
        row,
        np.concatenate(samples),
        np.concatenate(offsets),
        np.concatenate(ends),
        torch.from_numpy(targets),
        masked,
        torch.cat(picked),
    )


def _bucket(offsets: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(POSITION_BUCKETS), offsets, side="right") - 1


def _sums(
    groups: np.ndarray, hit1: np.ndarray, hit5: np.ndarray, log_prob: np.ndarray, size: int
) -> list[Agreement]:
    """One Agreement per group index 0..size-1 of the positions given."""
    positions = np.bincount(groups, minlength=size)
    top1 = np.bincount(groups, weights=hit1, minlength=size)
    top5 = np.bincount(groups, weights=hit5, minlength=size)
    total = np.bincount(groups, weights=log_prob, minlength=size)
    return [
        Agreement(int(positions[i]), int(top1[i]), int(top5[i]), float(total[i]))
        for i in range(size)
    ]


def score_positions(
    head: OutputHead, found: Positions, audit: ChunkAudit, exact: bool, eps: float
) -> tuple[list[int], str]:
    """Agreement of the final captured layer at ``found``, added into ``audit`` (chunk,
    samples, position buckets); with ``exact``, the greedy check: returns the samples whose
    generated tokens the states do not predict, and the likely cause."""
    final = found.states[:, -1]  # [n, H]
    # Ids past the head's vocabulary (a padded tokenizer's) are no target.
    found.targets[found.targets >= head.vocab_size] = -1
    # NaN, inf and all-zero vectors score nothing: the layer statistics name them.
    usable = torch.isfinite(final).all(dim=1) & (final != 0).any(dim=1) & (found.targets[:, 1] >= 0)
    keep = np.flatnonzero(usable.numpy())
    scores = head.score(found.states[keep, -1], found.targets[keep])
    targets = found.targets[keep]  # [n, 3]
    top1 = scores.top[:, :1] == targets  # [n, 3]
    top5 = (scores.top[:, :, None] == targets[:, None, :]).any(dim=1)  # [n, 3]
    log_prob = scores.target_logit - scores.log_norm[:, None]  # [n, 3]
    paired = (targets >= 0).all(dim=1).numpy()
    hit1, hit5 = top1[:, 1].numpy(), top5[:, 1].numpy()
    lp = log_prob[:, 1].double().numpy()
    masked = found.masked[keep]
    order = [s.sample for s in audit.sample_audits]
    index = np.searchsorted(np.asarray(order), found.samples[keep])  # into sample_audits
    buckets = _bucket(found.offsets[keep])
    for group, members in ((masked, "masked"), (~masked, "other")):
        for n, part in enumerate(
            _sums(index[group], hit1[group], hit5[group], lp[group], len(order))
        ):
            getattr(audit.sample_audits[n], members).add(part)
            getattr(audit, members).add(part)
    for n, part in enumerate(_sums(buckets, hit1, hit5, lp, len(POSITION_BUCKETS))):
        audit.by_position[n].add(part)
    _add_shifts(audit, index[paired], top1.numpy()[paired])
    if not exact:
        return [], ""
    return _check_greedy(head, found, keep, scores.top[:, 0], scores.top_logit, audit, eps)


def _add_shifts(audit: ChunkAudit, index: np.ndarray, hits: np.ndarray) -> None:
    """Top-1 ``hits [p, 3]`` at SHIFTS of positions where every shift has a target, by sample
    (``index`` into audit.sample_audits) and for the chunk."""
    per_sample = np.zeros((len(audit.sample_audits), len(SHIFTS)), dtype=np.int64)
    np.add.at(per_sample, index, hits.astype(np.int64))
    counts = np.bincount(index, minlength=len(audit.sample_audits))
    for n, sample in enumerate(audit.sample_audits):
        sample.shift_positions += int(counts[n])
        sample.shift_hits = [
            a + int(b) for a, b in zip(sample.shift_hits, per_sample[n], strict=True)
        ]
    audit.shift_positions += int(index.size)
    total = per_sample.sum(axis=0)
    audit.shift_hits = [a + int(b) for a, b in zip(audit.shift_hits, total, strict=True)]


def _check_greedy(
    head: OutputHead,
    found: Positions,
    keep: np.ndarray,
    top: torch.Tensor,
    top_logit: torch.Tensor,
    audit: ChunkAudit,
    eps: float,
) -> tuple[list[int], str]:
    """Every loss-masked position must predict its next token exactly (ties named as such)."""
    masked = np.flatnonzero(found.masked[keep])
    data = found.targets[keep][masked, 1]
    wrong = np.flatnonzero((top[masked] != data).numpy())
    states = found.states[keep[masked[wrong]], -1]
    data_logit = head.score(states, data[wrong, None]).target_logit[:, 0]
    margin = top_logit[masked[wrong]] - data_logit
    tolerance = head.tie_tolerance(states, top[masked[wrong]], data[wrong], eps)
    beyond = (margin > tolerance).numpy()
    by_sample = {s.sample: s for s in audit.sample_audits}
    counts: dict[int, Greediness] = {}
    for i in masked:
        sample = int(found.samples[keep[i]])
        greedy = counts.setdefault(sample, Greediness())
        greedy.positions += 1
        greedy.agree += 1
    for n, i in enumerate(masked[wrong]):
        greedy = counts[int(found.samples[keep[i]])]
        greedy.agree -= 1
        if beyond[n]:
            greedy.disagree += 1
            greedy.worst_margin = max(greedy.worst_margin, float(margin[n]))
        else:
            greedy.ties += 1
    for sample, greedy in counts.items():
        by_sample[sample].greedy = greedy
        audit.greedy.add(greedy)
    failing = sorted(s for s, g in counts.items() if g.disagree)
    if not failing:
        return [], ""
    # The likely cause: the states of another layer or another sample predict them.
    cause = _other_layer(head, found, keep, failing) or _swapped(head, found, keep, failing)
    return failing, cause


def greedy_finding(audit: ChunkAudit, failing: list[int], causes: list[str]) -> Finding:
    """The finding for samples of a chunk whose generated tokens the states do not predict."""
    by_sample = {s.sample: s for s in audit.sample_audits}
    listed = ", ".join(
        f"sample {s} ({by_sample[s].greedy.disagree} of {by_sample[s].greedy.positions})"
        for s in failing[:10]
    )
    total = audit.greedy
    cause = "; ".join(c for c in causes if c)
    return Finding(
        ERROR,
        "greedy-disagreement",
        f"chunk {audit.chunk}: {total.disagree} of {total.positions} generated positions do not "
        f"predict the next token as the target did (expected every one, the data being its "
        f"greedy output; largest margin {total.worst_margin:.4g}): {listed}"
        + (f". {cause}" if cause else ""),
        [audit.chunk],
        failing,
    )


def _greedy_rows(found: Positions, keep: np.ndarray, samples: list[int]) -> np.ndarray:
    """Indices into ``found`` of the loss-masked, finite positions of ``samples``."""
    chosen = keep[found.masked[keep]]
    return chosen[np.isin(found.samples[chosen], samples)]


def _other_layer(head: OutputHead, found: Positions, keep: np.ndarray, failing: list[int]) -> str:
    """Names the captured slot whose states predict the failing samples' generated tokens."""
    rows = _greedy_rows(found, keep, failing)
    layers = found.states.shape[1]
    for slot in range(layers - 1):
        states = found.states[rows, slot]
        if not bool(torch.isfinite(states).all()):
            continue
        top = head.score(states, found.targets[rows][:, 1:2]).top[:, 0]
        rate = float((top == found.targets[rows][:, 1]).float().mean()) if rows.size else 0.0
        if rate >= _DIAGNOSIS_RATE:
            return (
                f"Layer slot {slot} predicts them ({rate:.0%}): the layers are stored in the "
                "wrong order (the final state is not the last captured layer)"
            )
    return ""


def _swapped(head: OutputHead, found: Positions, keep: np.ndarray, failing: list[int]) -> str:
    """Names failing samples whose states predict another sample's generated tokens, at the
    same positions counted from the samples' starts or from their ends (a swap of rows of two
    samples of different lengths keeps one or the other)."""
    tops: dict[int, tuple[dict[int, int], dict[int, int]]] = {}
    for sample in failing:
        rows = keep[found.samples[keep] == sample]
        top = head.score(found.states[rows, -1], found.targets[rows][:, 1:2]).top[:, 0].tolist()
        tops[sample] = (
            dict(zip(found.offsets[rows].tolist(), top, strict=True)),
            dict(zip(found.ends[rows].tolist(), top, strict=True)),
        )
    candidates = sorted(set(found.samples[keep].tolist()))[:_MAX_CANDIDATES]
    pairs = []
    for a in failing:
        for b in candidates:
            rows = _greedy_rows(found, keep, [b])
            tokens = found.targets[rows, 1].tolist()
            for where, table in zip((found.offsets, found.ends), tops[a], strict=True):
                common = [
                    (table[k], t)
                    for k, t in zip(where[rows].tolist(), tokens, strict=True)
                    if k in table
                ]
                hits = sum(x == y for x, y in common)
                if a != b and len(common) >= 4 and hits >= _DIAGNOSIS_RATE * len(common):
                    pairs.append(f"sample {a} holds the states of sample {b}")
                    break
    return "; ".join(pairs)


def alignment_verdict(hits: list[int], positions: int) -> tuple[str, int | None]:
    """("aligned", 0), ("shifted", k) or ("undecided", None) from top-1 hits at SHIFTS."""
    if positions < MIN_DECISIVE_POSITIONS:
        return "undecided", None
    rates = [h / positions for h in hits]
    best = max(range(len(SHIFTS)), key=lambda i: rates[i])
    second = max(r for i, r in enumerate(rates) if i != best)
    if rates[best] >= MIN_DECISIVE_RATE and rates[best] >= MIN_DECISIVE_RATIO * second:
        shift = SHIFTS[best]
        return ("aligned" if shift == 0 else "shifted"), shift
    return "undecided", None
