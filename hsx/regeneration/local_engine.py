"""vLLM's engine in this process, driven by one thread, so that the turns of several chunks in
flight share its batches (continuous batching across chunks: one chunk's long last answers no
longer leave the engine idle while the next chunk waits behind a lock).

Callers on any thread submit requests and wait on futures; the driver adds what arrived, steps
the engine while anything is unfinished, and completes each future as its request finishes. An
engine that fails (its core process killed, say) fails every waiting request with an EngineError
naming the cause; the next submit builds a new engine.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from hsx.engine.core_watch import watch_engine_core
from hsx.engine.platform import request_amx
from hsx.engine.vllm_compat import unscannable_module_attributes_hidden
from hsx.errors import EngineError, RequestRefusedError
from hsx.regeneration.turns import GeneratedText
from settings import EngineSettings

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt_ids: list[int]  # [tokens]
    params: Any  # vllm.SamplingParams
    future: Future[GeneratedText]


class GenerationDriver:
    """One vLLM engine, built in and stepped by its own thread."""

    def __init__(self, kwargs: dict[str, Any], engine: EngineSettings) -> None:
        self._kwargs = kwargs
        self._settings = engine
        self._inbox: queue.Queue[list[_Request] | None] = queue.Queue()
        self._waiting: dict[str, Future[GeneratedText]] = {}
        self._ready: Future[None] = Future()
        self._stopped = False
        self._llm: Any = None
        self._thread = threading.Thread(target=self._drive, name="hsx-generation", daemon=True)
        self._thread.start()

    @property
    def llm(self) -> Any:
        """The loaded ``vllm.LLM`` (a benchmark's baseline on the same engine; only while no
        request of this driver is in flight: one thread steps an engine at a time)."""
        self._ready.result()
        return self._llm

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def submit(self, requests: Sequence[tuple[list[int], Any]]) -> list[Future[GeneratedText]]:
        """(prompt ids, SamplingParams) each; their futures, in order."""
        self._ready.result()  # the load's failure, raised to every caller
        batch = [_Request(ids, params, Future()) for ids, params in requests]
        self._inbox.put(batch)
        if not self.alive:  # died meanwhile: nobody would take the batch
            self._fail(batch, EngineError("vLLM generation engine stopped"))
        return [request.future for request in batch]

    def _drive(self) -> None:
        try:
            request_amx()  # before any vLLM kernel runs here: an AMX instruction would SIGILL
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self._settings.in_process else "1"
            if not self._settings.in_process:
                os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            from vllm import LLM

            with unscannable_module_attributes_hidden():  # numba's llvmlite: vllm_compat
                self._llm = LLM(**self._kwargs)
        except BaseException as exc:
            self._stopped = True
            self._ready.set_exception(
                EngineError(f"vLLM generation engine failed to load: {exc!r}")
            )
            return
        self._ready.set_result(None)
        threading.Thread(
            target=watch_engine_core,
            args=(self._llm, lambda: not self._stopped),
            name="hsx-generation-core-watch",
            daemon=True,
        ).start()
        try:
            self._loop(self._llm.llm_engine)
        except BaseException as exc:
            logger.error("vLLM generation engine failed: %r", exc, exc_info=True)
            self._stopped = True
            self._fail_all(EngineError(f"vLLM generation failed: {exc!r}"))
            self._shutdown()

    def _loop(self, engine: Any) -> None:
        from vllm.inputs import TokensPrompt

        while True:
            block = not self._waiting  # wait only while idle; else take what came and step
            while True:
                try:
                    batch = self._inbox.get(block=block)
                except queue.Empty:
                    break
                if batch is None:
                    self._stopped = True
                    self._fail_all(EngineError("vLLM generation engine closed"))
                    self._shutdown()
                    return
                for request in batch:
                    key = uuid.uuid4().hex
                    try:
                        engine.add_request(
                            key, TokensPrompt(prompt_token_ids=request.prompt_ids), request.params
                        )
                    except Exception as exc:  # this prompt alone; the engine stays up
                        request.future.set_exception(
                            RequestRefusedError(
                                f"generation request of {len(request.prompt_ids)} tokens: "
                                f"expected vLLM to accept it, found {exc!r}"
                            )
                        )
                        continue
                    self._waiting[key] = request.future
                block = False
            for output in engine.step():
                if output.finished and output.request_id in self._waiting:
                    completion = output.outputs[0]
                    self._waiting.pop(output.request_id).set_result(
                        GeneratedText(
                            tuple(int(t) for t in completion.token_ids),
                            str(completion.text),
                            str(completion.finish_reason),
                        )
                    )

    def _fail(self, batch: list[_Request], error: EngineError) -> None:
        for request in batch:
            if not request.future.done():
                request.future.set_exception(error)

    def _fail_all(self, error: EngineError) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()
        while True:
            try:
                batch = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._fail(batch or [], error)

    def _shutdown(self) -> None:
        try:
            core = getattr(self._llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        except Exception as exc:  # a dead engine may raise on shutdown; nothing to keep
            logger.debug("generation engine shutdown: %r", exc)
        self._llm = None

    def close(self, timeout_s: float = 60.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout_s)
