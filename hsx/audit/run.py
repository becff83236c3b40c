"""One audit of one store: everything checked before any state is read (the store, its commits,
the model folder against the store's config digest, the final norm and LM head), built once,
then chunk by chunk (a Prefect task each, or serially at the end of an extraction), then the
report."""

from __future__ import annotations

import time
from pathlib import Path

from hsx.audit.chunk import AuditContext, audit_chunk
from hsx.audit.data_shape import DataShape, data_shape
from hsx.audit.head import OutputHead, choose_device, find_head
from hsx.audit.layer_stats import POST_NORM_TOLERANCE
from hsx.audit.report import AuditReport, merge
from hsx.audit.results import ChunkAudit
from hsx.audit.scope import ChunkScope, greedy_provenance, select_chunks
from hsx.errors import ConfigError
from hsx.model.config import text_config
from hsx.store.reader import HiddenStatesReader
from hsx.trainers.final_norm import store_model_folder

# Relative error of a stored element, by the store's dtype: what the greedy check's ties allow
# (float32 also covers two runs' batches summing in another order).
STORED_EPS = {"float32": 2.0**-16, "bfloat16": 2.0**-7, "fp8_e4m3": 2.0**-4}
DEFAULT_DRAFT_VOCAB = 32_000


class StoreAudit:
    """The audit of one store, ready to run chunk by chunk."""

    def __init__(
        self,
        store: str,
        model: str | Path | None = None,
        positions: int = 0,
        samples: str | None = None,
        device: str = "auto",
        draft_vocab_size: int = DEFAULT_DRAFT_VOCAB,
        score: bool = True,
    ) -> None:
        """``positions``: rows whose states are read (0: all); ``score``: False where the model
        has no weights (load_format dummy): layer statistics and data shape only."""
        if draft_vocab_size < 1:
            raise ConfigError(f"--draft-vocab-size: expected 1 or more, found {draft_vocab_size}")
        self.reader = HiddenStatesReader(store)
        meta = self.reader.store.meta
        self.scopes = select_chunks(self.reader, positions, samples)  # refuses no commits
        self.folder, config = store_model_folder(model, meta, "audit")  # refuses another model
        self.head = OutputHead.load(self.folder, config, device) if score else None
        text = text_config(config)
        self.vocab_size = int(text.get("vocab_size") or 0)
        layer_ids = [int(i) for i in meta["layer_ids"]]
        encoding = self.reader.store.state_encoding
        dtype = encoding if encoding != "plain" else self.reader.logical_dtype
        self.greedy = greedy_provenance(meta)
        self.context = AuditContext(
            self.reader.store,
            self.head,
            layer_ids,
            layer_ids[-1] == int(text["num_hidden_layers"]),
            self.greedy.exact,
            STORED_EPS.get(dtype, STORED_EPS["bfloat16"]),
            POST_NORM_TOLERANCE.get(dtype, POST_NORM_TOLERANCE["bfloat16"]),
        )
        self.store_url = store
        self.positions = positions
        self.draft_vocab_size = draft_vocab_size
        self.scope_of = {scope.chunk: scope for scope in self.scopes}

    @property
    def audited_chunks(self) -> list[int]:
        """The chunks whose states are read (all in range, or a spread of them)."""
        return [s.chunk for s in self.scopes if s.windows]

    def audit_chunk(self, chunk: int) -> ChunkAudit:
        return audit_chunk(self.context, self.scope_of[chunk])

    def data_shape(self) -> DataShape:
        """The data's shape over every chunk in range (token arrays only)."""
        vocab = self.vocab_size or _largest_id(self.reader, self.scopes) + 1
        return data_shape(self.reader, self.scopes, vocab, self.draft_vocab_size)

    def report(self, audits: list[ChunkAudit], shape: DataShape, seconds: float) -> AuditReport:
        meta = self.reader.store.meta
        report = AuditReport(
            store=self.store_url,
            model=str(self.folder),
            head=None if self.head is None else vars(self.head.source),
            layer_ids=list(self.context.layer_ids),
            final_layer=self.context.final_layer,
            greedy={"exact": self.greedy.exact, "reason": self.greedy.reason},
            positions_requested=self.positions,
            chunks_planned=len(meta["work_chunks"]),
            chunks_committed=len(self.reader.store.committed_chunks()),
            data=shape,
        )
        merge(report, audits)
        report.seconds = round(seconds, 3)
        return report


def check_inputs(
    store: str,
    model: str | Path | None,
    positions: int,
    samples: str | None,
    device: str = "auto",
) -> None:
    """What StoreAudit refuses, in seconds and without reading the head (the CLI asks before a
    Prefect server starts): the store and its commits, the range, the model folder against the
    store's config digest, the final norm and the LM head's presence, the device."""
    choose_device(device, 0)
    reader = HiddenStatesReader(store)
    select_chunks(reader, positions, samples)
    folder, config = store_model_folder(model, reader.store.meta, "audit")
    find_head(folder, config)
    from hsx.trainers.final_norm import load_final_norm

    load_final_norm(folder, config)  # [H]: small


def _largest_id(reader: HiddenStatesReader, scopes: list[ChunkScope]) -> int:
    from hsx.trainers.vocab import token_rows

    largest = 0
    for _, ids, _ in token_rows(reader, [s for scope in scopes for s in scope.samples]):
        largest = max(largest, int(ids.max()) if ids.size else 0)
    return largest


def audit_store(
    store: str,
    model: str | Path | None = None,
    positions: int = 0,
    samples: str | None = None,
    device: str = "auto",
    score: bool = True,
) -> AuditReport:
    """The whole audit in this thread, chunk after chunk (the end of an extraction, tests)."""
    started = time.perf_counter()
    audit = StoreAudit(store, model, positions, samples, device, score=score)
    results = [audit.audit_chunk(chunk) for chunk in audit.audited_chunks]
    return audit.report(results, audit.data_shape(), time.perf_counter() - started)
