"""``hsx audit``: what the stored states mean, not only their bytes. The final captured layer
through the target's own final norm and LM head must predict each next token as the target did
(exactly, on greedy regenerated data); the best shift of states against tokens must be 0; every
layer's vectors are checked (NaN, inf, zero, constant, repeated, norms, fp8 scales); the data's
shape is summarized; plots are drawn (``hsx.audit.plots``, matplotlib, imported on use).

Callers use ``StoreAudit`` (checks before work, then chunk by chunk), ``audit_store`` (all of it
in one thread) and ``AuditReport``; ``render`` gives its text."""

from hsx.audit.head import HeadSource, OutputHead
from hsx.audit.render import brief, finding_lines, markdown, summary_lines
from hsx.audit.report import AuditReport
from hsx.audit.results import ERROR, NOTE, WARNING, ChunkAudit, Finding
from hsx.audit.run import StoreAudit, audit_store

__all__ = [
    "ERROR",
    "NOTE",
    "WARNING",
    "AuditReport",
    "ChunkAudit",
    "Finding",
    "HeadSource",
    "OutputHead",
    "StoreAudit",
    "audit_store",
    "brief",
    "finding_lines",
    "markdown",
    "summary_lines",
]
