"""Text generation behind one interface, with two homes chosen once (``make_generator``): vLLM's
``LLM`` in this process (its engine core here or in a child process, engine.in_process), or
vLLM OpenAI-compatible servers (engine.url: ``vllm serve``, one or several). Callers never
branch on where the engine lives.

Generation runs on a plain engine in this process. Through `hsx serve` (an extraction engine:
vLLM's extract_hidden_states speculative method and hsx's connector), generation is greedy only:
that method changes sampled generations (bench/bench_capture_sampling.py, vLLM 0.32 on this CPU:
a token equals the one before it in 77% of sampled tokens, 0.2% on a plain engine; greedy ids are
equal on both, here and on an H100 with vLLM 0.26), and it decodes at 0.68 (CPU) to 0.78 (H100)
of a plain engine's tokens/s.
"""

from __future__ import annotations

import json
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hsx.engine.options import cuda_available, engine_kwargs
from hsx.engine.server_protocol import INFO_PATH, authorization_header
from hsx.errors import ConfigError, EngineError
from hsx.regeneration.local_engine import GenerationDriver
from hsx.regeneration.turns import GeneratedText
from settings import EngineSettings

logger = logging.getLogger(__name__)

# Completions a served generator keeps in flight across all its servers.
SERVED_IN_FLIGHT = 1024

# Keys of engine_kwargs that make an extraction engine: a generation engine drops them.
_EXTRACTION_ONLY = ("speculative_config", "kv_transfer_config")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]  # [tokens]
    max_tokens: int
    seed: int


def sampling_fields() -> frozenset[str]:
    """The sampling parameters the installed vLLM knows (its SamplingParams' fields)."""
    from vllm import SamplingParams

    fields = getattr(SamplingParams, "__struct_fields__", None) or getattr(
        SamplingParams, "__dataclass_fields__", {}
    )
    return frozenset(name for name in fields if not name.startswith("_"))


def check_sampling(sampling: dict[str, Any]) -> None:
    """Refuse sampling parameters vLLM does not know, or values it rejects, before any load:
    ConfigError naming the key (and the closest known) or vLLM's own message."""
    import difflib

    from vllm import SamplingParams

    known = sampling_fields()
    for key in sampling:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"expected one of {sorted(known)}"
            raise ConfigError(
                f"generation.sampling: vLLM's SamplingParams has no parameter {key!r}: {hint}"
            )
    try:
        SamplingParams(**sampling, max_tokens=1, seed=0)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"generation.sampling {sampling}: vLLM refused it: {exc}") from exc


class TextGenerator(ABC):
    """Prompts of token ids in, each one's generated token ids, text and finish reason out."""

    @abstractmethod
    def submit(
        self, requests: Sequence[GenerationRequest], sampling: dict[str, Any]
    ) -> list[Future[GeneratedText]]:
        """One future per request, in order, each completed as its answer arrives (so a caller
        can send a conversation's next turn while others still generate). A future raises
        EngineError when the engine failed."""

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: dict[str, Any]
    ) -> list[GeneratedText]:
        """One answer per request, in order. Raises EngineError when the engine failed."""
        return [future.result() for future in self.submit(requests, sampling)]

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Where it runs, for run records and logs."""

    def close(self) -> None:  # noqa: B027 - optional
        """Free the engine."""


class LocalGenerator(TextGenerator):
    """vLLM's engine in this process (hsx.regeneration.local_engine): built at the first
    request; rebuilt after an engine death, so a retried chunk gets a fresh engine. Chunks
    generating at once share the engine's batches."""

    def __init__(self, model_dir: Path, engine: EngineSettings) -> None:
        self.model_dir = model_dir
        self.engine = engine
        self._driver: GenerationDriver | None = None
        self._lock = threading.Lock()

    def _running(self) -> GenerationDriver:
        with self._lock:
            if self._driver is None or not self._driver.alive:
                self._driver = GenerationDriver(
                    generation_kwargs(self.model_dir, self.engine), self.engine
                )
            return self._driver

    def submit(
        self, requests: Sequence[GenerationRequest], sampling: dict[str, Any]
    ) -> list[Future[GeneratedText]]:
        from vllm import SamplingParams

        # hsx decodes each turn from its ids itself; vLLM's incremental detokenizer (per token,
        # on the thread that steps the engine) is needed only to match stop strings.
        detokenize = bool(sampling.get("stop"))
        return self._running().submit(
            [
                (
                    r.prompt_ids,
                    SamplingParams(
                        **sampling, max_tokens=r.max_tokens, seed=r.seed, detokenize=detokenize
                    ),
                )
                for r in requests
            ]
        )

    @property
    def llm(self) -> Any:
        """The loaded ``vllm.LLM`` (GenerationDriver.llm says when it may be used)."""
        return self._running().llm

    def describe(self) -> dict[str, Any]:
        return {"home": "local", "in_process": self.engine.in_process}

    def close(self) -> None:
        with self._lock:
            driver, self._driver = self._driver, None
        if driver is not None:
            driver.close()


def generation_kwargs(model_dir: Path, engine: EngineSettings) -> dict[str, Any]:
    """``vllm.LLM`` arguments of a plain engine with extraction's own choices (dtype, lengths,
    attention backend, KV cache): what extraction runs, without capture, with prefix caching
    (each turn's prompt starts with the one before it)."""
    kwargs = engine_kwargs(model_dir, engine, [], sink_id="", spool_dir="")
    for key in _EXTRACTION_ONLY:
        kwargs.pop(key, None)
    kwargs["enable_prefix_caching"] = True
    if not cuda_available():
        # vLLM's CPU worker rewinds a seeded request's generator after a partial prefill
        # (Generator.set_offset), which CPU generators refuse: "CPU Generator does not use
        # offset" killed the engine once prompts of many conversations shared a step (seen with
        # 300 conversations). Prompts are prefilled whole there.
        kwargs["enable_chunked_prefill"] = False
    return kwargs


class ServedGenerator(TextGenerator):
    """vLLM OpenAI-compatible servers (``/v1/completions`` with prompt token ids and
    ``return_token_ids``), requests spread over them and sent concurrently."""

    def __init__(self, urls: Sequence[str], api_key: str | None, timeout_s: float) -> None:
        if not urls:
            raise ConfigError("engine.url: expected at least one server URL, found none")
        self.urls = [u.rstrip("/") for u in urls]
        self.headers = authorization_header(api_key)
        # One thread and connection per request in flight: chunks in flight x conversations
        # each, so the servers batch them all (httpx alone would cap at 100 connections).
        self.http = httpx.Client(
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=SERVED_IN_FLIGHT, max_keepalive_connections=64),
        )
        self.models = {url: self._model_name(url) for url in self.urls}
        # `hsx serve` answers GET INFO_PATH (its instance, layers): an extraction engine.
        self.extraction_servers = [url for url in self.urls if self._is_extraction_server(url)]
        self.pool = ThreadPoolExecutor(SERVED_IN_FLIGHT, thread_name_prefix="hsx-generate")
        self._lock = threading.Lock()
        self._sent = 0

    def _model_name(self, url: str) -> str:
        try:
            response = self.http.get(f"{url}/v1/models", headers=self.headers)
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise EngineError(
                f"engine.url {url}: expected /v1/models to name a model: {exc!r}"
            ) from exc

    def _is_extraction_server(self, url: str) -> bool:
        try:
            return self.http.get(f"{url}{INFO_PATH}", headers=self.headers).status_code == 200
        except httpx.HTTPError:
            return False  # it answered /v1/models: a server without hsx's route

    def submit(
        self, requests: Sequence[GenerationRequest], sampling: dict[str, Any]
    ) -> list[Future[GeneratedText]]:
        with self._lock:  # spread over the servers across calls, not only within one
            first, self._sent = self._sent, self._sent + len(requests)
        return [
            self.pool.submit(self._one, self.urls[(first + i) % len(self.urls)], request, sampling)
            for i, request in enumerate(requests)
        ]

    def _one(self, url: str, request: GenerationRequest, sampling: dict[str, Any]) -> GeneratedText:
        body = {
            **sampling,
            "model": self.models[url],
            "prompt": request.prompt_ids,
            "max_tokens": request.max_tokens,
            "seed": request.seed,
            "return_token_ids": True,
        }
        try:
            response = self.http.post(f"{url}/v1/completions", json=body, headers=self.headers)
        except httpx.HTTPError as exc:
            raise EngineError(f"engine.url {url}: completion request failed: {exc!r}") from exc
        if response.status_code != 200:
            raise EngineError(
                f"engine.url {url}: expected HTTP 200 for a completion, found "
                f"{response.status_code}: {response.text[:500]}"
            )
        choice = response.json()["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:
            raise EngineError(
                f"engine.url {url}: expected token_ids in the answer (return_token_ids), found "
                f"keys {sorted(choice)}: the server's vLLM is too old"
            )
        return GeneratedText(
            token_ids=tuple(int(t) for t in ids),
            text=str(choice.get("text") or ""),
            finish_reason=str(choice.get("finish_reason")),
        )

    def describe(self) -> dict[str, Any]:
        return {"home": "served", "urls": self.urls}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


# generation_config.json keys vLLM applies as sampling defaults (ModelConfig's
# get_diff_sampling_param, which `vllm serve` applies to every request and `LLM.generate` with
# explicit SamplingParams does not).
MODEL_SAMPLING_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
)


def model_sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling defaults the model folder's generation_config.json sets ({} without one)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: expected a JSON object, found unreadable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return {key: config[key] for key in MODEL_SAMPLING_KEYS if config.get(key) is not None}


def effective_sampling(model_dir: Path, sampling: dict[str, Any]) -> dict[str, Any]:
    """What every request is sent: the model's defaults under the run's own parameters, whole,
    so an in-process engine and any server generate alike (a server would otherwise apply the
    model's defaults and this process vLLM's neutral ones)."""
    return {**model_sampling_defaults(model_dir), **sampling}


def is_greedy(sampling: dict[str, Any]) -> bool:
    """Whether these sampling parameters pick the likeliest token (vLLM's default temperature
    is 1.0: greedy is asked for, never assumed)."""
    return float(sampling.get("temperature", 1.0)) == 0.0


def check_capture_engine_sampling(sampling: dict[str, Any], where: str) -> None:
    """Refuse sampled generation on an extraction engine (``where`` names it): see the module's
    docstring for what was measured."""
    if is_greedy(sampling):
        return
    raise ConfigError(
        f'generation.sampling: expected greedy ({{"temperature": 0}}) to regenerate on an '
        f"extraction engine ({where}), found {sampling or 'vLLM defaults (temperature 1.0)'}: "
        "vLLM's extract_hidden_states method changes sampled generations (77% of sampled tokens "
        "repeated the one before, 0.2% on a plain engine: bench/bench_capture_sampling.py). "
        "Regenerate on a plain engine (in this process, or `vllm serve` via --engine-url), then "
        "`hsx extract` the output."
    )


def make_generator(
    model_dir: Path, engine: EngineSettings, timeout_s: float, sampling: dict[str, Any]
) -> TextGenerator:
    """The generator for these settings: servers where engine.url names them, else local.
    Sampled generation through `hsx serve` (an extraction engine) is refused."""
    if engine.url:
        key = engine.api_key.get_secret_value() if engine.api_key else None
        served = ServedGenerator(engine.url, key, timeout_s)
        if served.extraction_servers:
            try:
                check_capture_engine_sampling(sampling, ", ".join(served.extraction_servers))
            except ConfigError:
                served.close()
                raise
        return served
    return LocalGenerator(model_dir, engine)
