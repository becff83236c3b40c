"""vLLM behind a small interface: prompts of token ids in, hidden states ``[tokens, K, H]`` out.

Capture uses vLLM's own ``extract_hidden_states`` speculative method (each model's own forward
collects the aux layers; no re-implemented forward, no hooks) and hsx's connector. The engine is
built once per process and cached by its settings; one batch runs at a time because vLLM's
offline ``LLM`` is not safe to drive from several threads.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hsx.engine import connector as hsx_connector
from hsx.engine.options import REQUEST_KEY, engine_kwargs, resolve_dtype
from hsx.errors import ConfigError, EngineError
from hsx.plan import read_config, text_config
from settings import EngineSettings

logger = logging.getLogger(__name__)


class VllmHiddenStateEngine:
    """One loaded vLLM engine that returns the hidden states of each prompt."""

    def __init__(self, model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int]) -> None:
        from vllm import LLM

        self.model_dir = model_dir
        self.settings = engine
        self.layer_ids = tuple(layer_ids)
        config = text_config(read_config(model_dir))
        self.hidden_size = int(config["hidden_size"])
        self.dtype = resolve_dtype(engine, read_config(model_dir))
        self._sink_id = f"hsx-{uuid.uuid4().hex}"
        self._spool = tempfile.mkdtemp(
            prefix="hsx-spool-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        self._results: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        if engine.in_process:
            hsx_connector.register_sink(self._sink_id, self._results.__setitem__)
        # Read by vLLM when the engine is built: in-process core (fast start) or a child process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if engine.in_process else "1"
        started = time.perf_counter()
        try:
            self._llm = LLM(
                **engine_kwargs(model_dir, engine, self.layer_ids, self._sink_id, self._spool)
            )
        except Exception:
            hsx_connector.unregister_sink(self._sink_id)
            raise
        self.load_seconds = time.perf_counter() - started
        self._closed = False
        logger.info(
            "vLLM engine for %s ready in %.1f s (dtype %s, layers %s)",
            model_dir,
            self.load_seconds,
            self.dtype,
            self.layer_ids,
        )

    def extract(self, prompts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Hidden states of each prompt (token ids ``[tokens]``), each ``[tokens, K, H]``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._closed:
            raise EngineError("engine is closed; a retry builds a new one")
        with self._lock:
            batch = uuid.uuid4().hex[:12]
            keys = [f"{batch}-{i}" for i in range(len(prompts))]
            requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
            params = [
                SamplingParams(
                    max_tokens=1,
                    extra_args={"kv_transfer_params": {REQUEST_KEY: key}},
                )
                for key in keys
            ]
            try:
                self._llm.generate(requests, params, use_tqdm=False)
            except Exception as exc:
                raise EngineError(
                    f"vLLM generate failed for a batch of {len(prompts)} prompts: {exc!r}"
                ) from exc
            return [self._take(key, len(prompt)) for key, prompt in zip(keys, prompts, strict=True)]

    def _take(self, key: str, expected_tokens: int) -> torch.Tensor:
        rows = self._results.pop(key, None)
        if rows is None:
            path = hsx_connector.spool_path(self._spool, key)
            if path.exists():
                from safetensors.torch import load_file

                rows = load_file(str(path))["hidden_states"]
                path.unlink()
        if rows is None:
            raise EngineError(
                f"request {key}: expected hidden states from the connector, found none"
            )
        expected = (expected_tokens, len(self.layer_ids), self.hidden_size)
        if tuple(rows.shape) != expected:
            raise EngineError(
                f"request {key}: expected hidden states of shape {expected}, found {tuple(rows.shape)}"
            )
        return rows

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        hsx_connector.unregister_sink(self._sink_id)
        try:
            engine_core = getattr(self._llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
        except Exception:  # shutting down a dead engine may raise; nothing to keep
            logger.debug("engine shutdown raised", exc_info=True)
        del self._llm
        for leftover in Path(self._spool).glob("*"):
            leftover.unlink(missing_ok=True)
        os.rmdir(self._spool)


# ---- one engine per process, keyed by what builds it ------------------------------------------
_ENGINES: dict[str, VllmHiddenStateEngine] = {}
_ENGINES_LOCK = threading.Lock()


def engine_key(model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int]) -> str:
    return json.dumps(
        {
            "model": str(model_dir.resolve()),
            "engine": engine.model_dump(mode="json"),
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
        if cached is not None and not cached._closed:
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


def drop_engine(model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int]) -> None:
    """Forget (and close) an engine that failed, so the retry rebuilds it."""
    with _ENGINES_LOCK:
        dead = _ENGINES.pop(engine_key(model_dir, engine, layer_ids), None)
    if dead is not None:
        dead.close()


def close_all_engines() -> None:
    with _ENGINES_LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for engine in engines:
        engine.close()
