"""vLLM behind a small interface: prompts of token ids in, hidden states ``[tokens, K, H]`` out.

Capture uses vLLM's own ``extract_hidden_states`` speculative method (each model's own forward
collects the aux layers; no re-implemented forward, no hooks) and hsx's connector. The engine is
built once per process and cached by its settings; one batch runs at a time because vLLM's
offline ``LLM`` is not safe to drive from several threads.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsx import timings
from hsx.engine import connector as hsx_connector
from hsx.engine.capture_checks import CapturedDataError, check_token_ids
from hsx.engine.capture_models import register_capture_classes
from hsx.engine.core_watch import watch_engine_core
from hsx.engine.options import engine_kwargs, resolve_dtype, result_ring_bytes
from hsx.engine.platform import cpu_thread_binding, enable_fault_reports, request_amx
from hsx.engine.result_ring import READY_FIFO, RING_FILE, ring_granules
from hsx.engine.results import ResultRendezvous
from hsx.engine.server_protocol import ENCODING_PARAM
from hsx.engine.shm_folders import make_owned_folder
from hsx.engine.vllm_compat import unscannable_module_attributes_hidden
from hsx.errors import ConfigError, EngineError, RequestRefusedError
from hsx.model.config import read_config, text_config
from hsx.store.fp8_states import ENCODING as FP8_ENCODING
from hsx.store.fp8_states import PACKED_SCALE_BYTES
from settings import EngineSettings

logger = logging.getLogger(__name__)

# The engine's spool and result ring, in shared memory (hsx.engine.shm_folders).
SPOOL_PREFIX = "hsx-spool-"


def _on_cuda() -> bool:
    """Whether vLLM will run on an NVIDIA GPU here (the CPU build has no CUDA)."""
    return bool(torch.cuda.is_available())


@dataclass
class _Pending:
    """A prompt submitted to the driver, not yet added to the engine."""

    key: str
    token_ids: list[int]
    future: Future[torch.Tensor]
    packed_fp8: bool = False  # quantized on the GPU, delivered as fp8_states.pack's rows


class VllmHiddenStateEngine:
    """One loaded vLLM engine that returns the hidden states of each prompt.

    A single driver thread owns the engine (vLLM's ``LLM`` is not safe to drive from several
    threads): callers enqueue prompts and wait on futures, and the driver keeps stepping while
    any request is unfinished. Batches of different chunk tasks therefore share engine steps
    (continuous batching across chunk boundaries) instead of queueing behind a lock, so the
    engine stays busy while a chunk's last objects are written and committed."""

    def __init__(self, model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int]) -> None:
        self.model_dir = model_dir
        self.settings = engine
        self.layer_ids = tuple(layer_ids)
        config = read_config(model_dir)
        self.hidden_size = int(text_config(config)["hidden_size"])
        self.dtype = resolve_dtype(engine, config)
        self._sink_id = f"hsx-{uuid.uuid4().hex}"
        # Engine request ids whose rows the connector packs (fp8 on the GPU); set by the driver
        # thread before the request runs, read once where its rows are checked.
        self._packed_ids: set[str] = set()
        self._spool = make_owned_folder(SPOOL_PREFIX)
        # Rows and finished requests meet here, in either order (copies are asynchronous on
        # GPUs; a child engine process delivers through the shared-memory result ring).
        # Under tensor parallelism the workers (and rank 0's connector) are processes of their
        # own even with the engine core in this one: they hand over through the ring too.
        across_processes = not engine.in_process or engine.tensor_parallel_size > 1
        # On a GPU the in-process engine hands over through the ring as well: its pinned memory
        # is registered once, where rows copied into pinned buffers from torch's caching host
        # allocator paid cudaHostAlloc while that cache grew (H200: 2.7 s in the steps of a
        # first 10 s pass, 0.87 of plain against 0.98 for a later pass).
        through_ring = across_processes or _on_cuda()
        ring_bytes = result_ring_bytes(engine, self._spool) if through_ring else 0
        self._rendezvous = ResultRendezvous(
            self._check,
            spool_dir=self._spool if through_ring else None,
            ring_bytes=ring_bytes,
        )
        if not through_ring:
            hsx_connector.register_sink(self._sink_id, self._rendezvous.deliver)
        # Read by vLLM when the engine is built: in-process core (fast start) or a child process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if engine.in_process else "1"
        if across_processes:
            # This process already runs hsx's threads (I/O, writers, Prefect's, the tokenizer's
            # pool): a fork would copy their locks mid-use into the engine core or the TP
            # workers. Spawn starts them clean.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # One item per submitted batch: the driver takes a whole batch per queue operation
        # instead of trading the GIL with the submitting thread for every prompt.
        self._inbox: queue.Queue[list[_Pending] | None] = queue.Queue()
        # key -> (prompt tokens, future, the engine's request id)
        # key -> (planned token ids, future, engine request id)
        self._waiting: dict[str, tuple[list[int], Future[torch.Tensor], str]] = {}
        self._adding: list[_Pending] = []  # the batch being added (failed with the waiters)
        self._failure: BaseException | None = None
        self._closed = False
        self._core_death = ""  # how the engine core process died, once it has
        self._ready: Future[None] = Future()
        kwargs = engine_kwargs(
            model_dir,
            engine,
            self.layer_ids,
            self._sink_id,
            self._spool,
            config=config,
            ring_granules=ring_granules(ring_bytes) if ring_bytes else 0,
        )
        self.attention_backend = kwargs.get("attention_backend")
        self._architectures = list(config.get("architectures") or [])
        # Set for the engine's processes only (they copy the environment when they start):
        # left set, it would bind a later one-rank engine of this process to one rank's CPUs.
        bind_set_here = False
        if engine.tensor_parallel_size > 1 and not torch.cuda.is_available():
            binding = cpu_thread_binding(engine.tensor_parallel_size)
            if binding is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding  # a user's own is kept
                bind_set_here = True
        enable_fault_reports()  # a fatal signal in a kernel prints every thread's traceback
        request_amx()
        started = time.perf_counter()
        # The driver thread builds the engine and is the only thread that ever touches it: vLLM's
        # CPU worker binds the thread that initialized it, and its kernels measured ~30% slower
        # when stepped from another thread.
        self._driver = threading.Thread(
            target=self._drive, args=(kwargs,), name="hsx-engine-driver", daemon=True
        )
        self._driver.start()
        try:
            self._ready.result()
        except BaseException:
            hsx_connector.unregister_sink(self._sink_id)
            self._rendezvous.close()
            shutil.rmtree(self._spool, ignore_errors=True)
            raise
        finally:
            if bind_set_here:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        # The engine's processes opened the ring and the FIFO while it was built: their names can
        # go now, so that a process killed later leaves no GiBs of /dev/shm behind (the memory
        # is freed with the last mapping). Spool files of a full ring still use the folder.
        for name in (RING_FILE, READY_FIFO):
            (Path(self._spool) / name).unlink(missing_ok=True)
        atexit.register(shutil.rmtree, self._spool, True)
        self.load_seconds = time.perf_counter() - started
        logger.info(
            "vLLM engine for %s ready in %.1f s (dtype %s, layers %s)",
            model_dir,
            self.load_seconds,
            self.dtype,
            self.layer_ids,
        )

    @property
    def alive(self) -> bool:
        return not self._closed and self._failure is None and self._driver.is_alive()

    def submit(
        self, prompts: Sequence[np.ndarray], state_encoding: str = ""
    ) -> list[Future[torch.Tensor]]:
        """Queue prompts (token ids ``[tokens]``); each future gives ``[tokens, K, H]``, or
        for ``state_encoding`` fp8_e4m3 on a GPU packed rows ``[tokens, K, H + 4]`` uint8
        (quantized there: half the bytes over PCIe and through the ring)."""
        if not self.alive:
            raise EngineError(
                f"engine for {self.model_dir} is not alive ({self._failure!r}); a retry builds a new one"
            )
        batch = uuid.uuid4().hex[:12]
        # Token lists are built here, in the caller's thread, not in the engine's.
        packed = state_encoding == FP8_ENCODING and _on_cuda()
        pending = [
            _Pending(f"{batch}-{i}", prompt.tolist(), Future(), packed)
            for i, prompt in enumerate(prompts)
        ]
        self._inbox.put(pending)
        return [item.future for item in pending]

    def extract(self, prompts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Hidden states of each prompt, each ``[tokens, K, H]`` (submit and wait)."""
        return [future.result() for future in self.submit(prompts)]

    def _drive(self, kwargs: dict[str, Any]) -> None:
        try:
            # Before any vLLM kernel runs in this process: an AMX instruction executed before
            # Linux granted AMX kills the process with SIGILL and no traceback.
            request_amx()
            from vllm import LLM

            # Architectures vLLM cannot hand aux states for get hsx's hooks (hsx.engine.
            # capture_models), registered where the engine is built: this process.
            register_capture_classes(self._architectures)
            with unscannable_module_attributes_hidden():
                self._llm = LLM(**kwargs)
        except BaseException as exc:
            self._failure = exc
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        threading.Thread(
            target=self._watch_engine_core, name="hsx-engine-core-watch", daemon=True
        ).start()
        from vllm import SamplingParams

        engine = self._llm.llm_engine
        # One sampled token ends a request; its text is never needed, nor is the token: greedy is
        # the cheapest sampler (under extract_hidden_states vLLM samples through its rejection
        # sampler: 3.5 ms a step random, 0.5 ms greedy, measured). One object for every request
        # (vLLM clones it): results are matched by the engine's own request ids.
        params = SamplingParams(max_tokens=1, detokenize=False, temperature=0.0)
        # Requests of an fp8 store on a GPU: the connector quantizes their rows there.
        packed = SamplingParams(
            max_tokens=1,
            detokenize=False,
            temperature=0.0,
            extra_args={"kv_transfer_params": {ENCODING_PARAM: FP8_ENCODING}},
        )
        try:
            while True:
                # Block only when the engine is idle; otherwise take what arrived and step.
                block = not self._waiting
                while True:
                    try:
                        item = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    if item is None:
                        self._shutdown()
                        return
                    self._add_batch(engine, item, params, packed)
                    block = False
                started = time.perf_counter()
                outputs = engine.step()
                timings.add("engine_step", time.perf_counter() - started)
                for output in outputs:
                    if output.finished and output.request_id in self._waiting:
                        ids, future, engine_id = self._waiting.pop(output.request_id)
                        mismatch = check_token_ids(output.request_id, ids, output.prompt_token_ids)
                        if mismatch is not None:
                            future.set_exception(CapturedDataError(mismatch))
                            future = Future()  # the rows still arrive: received and dropped
                        self._rendezvous.expect(engine_id, len(ids), future)
        except BaseException as exc:  # the engine died: fail every waiter, keep the cause
            self._failure = exc
            death = f"; {self._core_death}" if self._core_death else ""
            logger.error("vLLM engine driver failed: %r%s", exc, death, exc_info=True)
            self._fail_waiters(EngineError(f"vLLM engine failed: {exc!r}{death}"))

    def _watch_engine_core(self) -> None:
        """Wake the driver when the engine core's process dies (hsx.engine.core_watch)."""
        death = watch_engine_core(self._llm, lambda: not self._closed and self._failure is None)
        if death is not None:
            self._core_death = death

    def _add_batch(self, engine: Any, batch: list[_Pending], params: Any, packed: Any) -> None:
        """Add a submitted batch's requests to the engine (in the driver thread)."""
        from vllm.inputs import TokensPrompt

        self._adding = batch
        for item in batch:
            try:
                # vLLM makes the id unique (key + random suffix) and returns it; the connector
                # sees only that id, so results are keyed by it.
                engine_id = engine.add_request(
                    item.key,
                    TokensPrompt(prompt_token_ids=item.token_ids),
                    packed if item.packed_fp8 else params,
                )
            except Exception as exc:  # this prompt alone: the engine stays up
                refused = RequestRefusedError(
                    f"request {item.key} of {len(item.token_ids)} tokens: expected vLLM to "
                    f"accept it, found {exc!r}"
                )
                refused.__cause__ = exc
                item.future.set_exception(refused)
                continue
            if not isinstance(engine_id, str):
                raise EngineError(
                    "LLMEngine.add_request: expected the engine's request id (str), "
                    f"found {engine_id!r}"
                )
            if item.packed_fp8:
                self._packed_ids.add(engine_id)  # its rows arrive packed (checked in _check)
            self._waiting[item.key] = (item.token_ids, item.future, engine_id)
        self._adding = []

    def _fail_waiters(self, error: EngineError) -> None:
        unfinished = [future for _, future, _ in self._waiting.values()]
        unfinished += [item.future for item in self._adding]
        self._waiting.clear()
        self._adding = []
        while True:
            try:
                batch = self._inbox.get_nowait()
            except queue.Empty:
                break
            unfinished += [item.future for item in batch or []]
        for future in unfinished:
            if not future.done():
                future.set_exception(error)
        self._rendezvous.fail_all(error)

    def _check(self, key: str, expected_tokens: int, rows: torch.Tensor) -> torch.Tensor:
        packed = key in self._packed_ids
        self._packed_ids.discard(key)
        width = self.hidden_size + (PACKED_SCALE_BYTES if packed else 0)
        expected = (expected_tokens, len(self.layer_ids), width)
        if tuple(rows.shape) != expected or (packed and rows.dtype != torch.uint8):
            raise EngineError(
                f"request {key}: expected hidden states of shape {expected}"
                f"{' (packed fp8, uint8)' if packed else ''}, found {tuple(rows.shape)} "
                f"{rows.dtype}"
            )
        return rows

    def _shutdown(self) -> None:
        """In the driver thread: stop the engine core (a child process, or in-process state)."""
        try:
            engine_core = getattr(self._llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
        except Exception:  # shutting down a dead engine may raise; nothing to keep
            logger.debug("engine shutdown raised", exc_info=True)
        del self._llm

    @property
    def pending_requests(self) -> int:
        """Work submitted whose states have not come back yet: batches queued for the driver,
        requests in the engine, and computed requests whose rows are still on their way."""
        return self._inbox.qsize() + len(self._waiting) + self._rendezvous.pending()

    def describe(self) -> dict[str, Any]:
        """Where this engine runs (the same process, or its child engine-core process)."""
        return {
            "home": "in-process" if self.settings.in_process else "child process",
            "model": str(self.model_dir),
            "pid": os.getpid(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        if self._driver.is_alive():
            self._driver.join(timeout=120)
        self._fail_waiters(EngineError("engine closed"))
        self._rendezvous.close()
        hsx_connector.unregister_sink(self._sink_id)
        for leftover in Path(self._spool).glob("*"):
            leftover.unlink(missing_ok=True)
        os.rmdir(self._spool)


# ---- one engine per process, keyed by what builds it ------------------------------------------
_ENGINES: dict[str, VllmHiddenStateEngine] = {}
_ENGINES_LOCK = threading.Lock()


def engine_key(model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int]) -> str:
    """What builds the engine: the model, the engine's building fields, the layer ids (not the
    batch size or servers, which only change how hsx feeds it)."""
    return json.dumps(
        {
            "model": str(model_dir.resolve()),
            "engine": engine.build_identity(),
            "layers": list(layer_ids),
        },
        sort_keys=True,
    )


def get_engine(
    model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int]
) -> VllmHiddenStateEngine:
    """The process's engine for these settings, built on first use (the long model load)."""
    key = engine_key(model_dir, engine, layer_ids)
    with _ENGINES_LOCK:
        cached = _ENGINES.get(key)
        if cached is not None and cached.alive:
            return cached
        if _ENGINES:
            # One engine per process: a different model or setting replaces the old one.
            for old in _ENGINES.values():
                old.close()
            _ENGINES.clear()
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"model folder {model_dir}: expected config.json, found none")
        built = VllmHiddenStateEngine(model_dir, engine, layer_ids)
        _ENGINES[key] = built
        return built


def engine_is_loaded(model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int]) -> bool:
    """True when this process already holds a live engine for these settings."""
    with _ENGINES_LOCK:
        cached = _ENGINES.get(engine_key(model_dir, engine, layer_ids))
    return cached is not None and cached.alive


def drop_engine(model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int]) -> None:
    """Forget (and close) an engine that failed, so the retry rebuilds it."""
    with _ENGINES_LOCK:
        dead = _ENGINES.pop(engine_key(model_dir, engine, layer_ids), None)
    if dead is not None:
        dead.close()


def loaded_engines() -> list[VllmHiddenStateEngine]:
    """The engines this process holds (at most one): for health checks and tests."""
    with _ENGINES_LOCK:
        return list(_ENGINES.values())


def close_all_engines() -> None:
    with _ENGINES_LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for engine in engines:
        engine.close()
