"""hsx's error model: every failure is fatal (never retried) or transient (retried with backoff).

A message names what was expected and what was found. An empty message is a bug: the constructor
refuses one, so the seed's ``ERROR in batch 0-4: `` cannot happen through these classes.
"""

from __future__ import annotations


class HsxError(Exception):
    """Base of hsx errors. ``retryable`` tells the Prefect retry condition what to do."""

    retryable: bool = False

    def __init__(self, message: str) -> None:
        if not message or not message.strip():
            raise ValueError(f"{type(self).__name__} needs a message naming expected and found")
        super().__init__(message)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class FatalError(HsxError):
    """Configuration, signature, data validation or shape errors: retrying cannot help."""

    retryable = False


class TransientError(HsxError):
    """Engine crash, I/O timeout, storage throttling: worth retrying with backoff."""

    retryable = True


class ConfigError(FatalError):
    """Bad settings, model folder or layer ids."""


class DatasetError(FatalError):
    """A dataset file or line that cannot be used; names the file and line."""


class StoreError(FatalError):
    """A store whose layout, plan or attributes do not match what this run expects."""


class StorageFullError(StoreError):
    """The store's file system has no space left (ENOSPC, EDQUOT). Fatal, not retried: a full
    disk does not heal within the seconds of a retry's backoff, and each retry of a chunk redoes
    its engine work only to fail at the same write; freeing space and re-running extracts only
    the chunks without a commit."""


class StoreReadOnlyError(StoreError):
    """The store's file system is mounted read-only (EROFS): no retry can write to it."""


class CorruptRecordError(StoreError):
    """A commit record that does not parse (a flipped byte, a foreign file): resume refuses to
    guess; verify reports it as that chunk's problem and ``--repair`` drops it."""

    def __init__(self, message: str, chunk_index: int) -> None:
        super().__init__(message)
        self.chunk_index = chunk_index

    def __reduce__(self) -> tuple[type[CorruptRecordError], tuple[str, int]]:
        return (type(self), (str(self), self.chunk_index))


class StorageIOError(TransientError):
    """An I/O error of the store's device or service (EIO, a dropped connection, throttling
    beyond the client's own retries): retried, since these heal (a flaky link, a controller
    reset, an object store shedding load); a chunk that keeps failing stops after its retries."""


class AuditFailedError(FatalError):
    """A store's states do not line up with its tokens (shifted, shorter than the tokens): the
    end-of-run audit fails the run, naming the chunks and samples; retrying cannot help."""


class RequestRefusedError(FatalError):
    """vLLM refused one prompt (too long for max_model_len, ...): the same prompt would be
    refused again; the engine itself is fine."""


class EngineError(TransientError):
    """The engine died or returned incomplete results; a retry rebuilds it."""


def is_retryable(exc: BaseException) -> bool:
    """Unknown exceptions (OSError, RuntimeError from deep inside a library) count as transient:
    a retry is cheap next to losing a chunk; known-fatal hsx errors are never retried."""
    if isinstance(exc, HsxError):
        return exc.retryable
    return not isinstance(
        exc, (TypeError, ValueError, KeyError, AttributeError, NotImplementedError)
    )


class CarriedError(HsxError):
    """An error that cannot be pickled (pydantic's ValidationError, errors holding locks or
    engine handles), carried as its type name, message and traceback text, so that Prefect
    can store a failed task's result; keeps the original's retry decision."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable

    def __reduce__(self) -> tuple[type[CarriedError], tuple[str, bool]]:
        return (type(self), (str(self), self.retryable))


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling, else a CarriedError with its repr and
    traceback (the retry decision kept)."""
    import pickle
    import traceback

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        pass
    text = "".join(traceback.format_exception(exc)).rstrip()
    return CarriedError(f"{exc!r}\n{text}", retryable=is_retryable(exc))
