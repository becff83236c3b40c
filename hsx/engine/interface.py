"""One engine interface, whatever its home: an engine of this process (vLLM's core in-process
or in a child process) or a running `hsx serve` server.

Callers get an ``EngineHome`` from ``make_engine_home`` once per run and borrow an engine per
work chunk; none of them branches on where the engine lives (vLLM's
``EngineCoreClient.make_client`` is the model: one abstract client, the home chosen once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import torch


class HiddenStateEngine(Protocol):
    """An engine that computes the captured hidden states of prompts (token ids ``[tokens]``);
    each result is ``[tokens, K, H]``: the K captured layers of every token."""

    @property
    def alive(self) -> bool: ...

    def submit(
        self, prompts: Sequence[np.ndarray], state_encoding: str = ""
    ) -> list[Future[torch.Tensor]]:
        """Queue prompts without waiting; one future per prompt. ``state_encoding``: the
        caller's store's (fp8_e4m3: an engine on a GPU may quantize there and deliver packed
        rows ``[tokens, K, H + 4]`` uint8, hsx.store.fp8_states.pack; others deliver states)."""
        ...

    def extract(self, prompts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Submit and wait."""
        ...

    def describe(self) -> dict[str, Any]:
        """Where the engine runs, as a commit record keeps it."""
        ...

    def close(self) -> None: ...


class EngineHome(ABC):
    """Where a run's engines live. A work chunk borrows one engine for its whole length."""

    #: "in-process", "child process" or "server": for logs and run records only.
    kind: str
    #: Prompt tokens a run keeps queued across this home's engines (hsx.extraction.host_pipeline).
    queue_limit: int

    @abstractmethod
    def borrow(self) -> AbstractContextManager[HiddenStateEngine]:
        """An engine for one chunk; given back when the chunk ends. An EngineError raised inside
        drops a dead engine (the retry gets a rebuilt one or another server's)."""

    @abstractmethod
    def record_of(self, engine: HiddenStateEngine) -> dict[str, Any]:
        """What a chunk's commit record keeps of the engine that computed it."""

    @abstractmethod
    def close(self) -> None:
        """The run is over. Engines and server channels stay cached for the process (a
        long-lived worker keeps its 18-minute model load across runs)."""
