"""A running `hsx serve` server as an engine: prompts of token ids in, ``[tokens, K, H]`` out.

Each prompt is one OpenAI completion (``max_tokens=1``, greedy) sent to vLLM's own server; the
request names this client's *channel* (a shared-memory result ring in /dev/shm, created here,
one per server) and a key, and hsx's connector in the server's engine copies the rows straight
into that ring (hsx.engine.result_ring). The HTTP answer says the request finished, which server
instance computed it and a digest of the prompt it computed; the rows meet it in a
ResultRendezvous, as for an engine in a child process. The server must therefore run on this
node: ``/hsx/info`` names its host and every identity the run depends on, and the client refuses
a server that differs from the plan (model config, weights, layer ids, dtype, lengths) before it
sends any work.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from hsx.capture_checks import CapturedDataError
from hsx.engine.result_ring import READY_FIFO, RING_FILE, ring_granules
from hsx.engine.results import ResultRendezvous
from hsx.engine.server_protocol import (
    CHANNEL_PREFIX,
    INFO_PATH,
    PARAMS_KEY,
    ChannelRequest,
    identity_problems,
    prompt_digest,
)
from hsx.errors import ConfigError, EngineError, RequestRefusedError

logger = logging.getLogger(__name__)

# The rows of a request the server answered arrive within milliseconds through the ring: a
# request still without rows after this long was lost (the server died after answering).
RESULT_WAIT_S = 60.0
# The first request's rows (the handshake) must arrive this fast, or the channel is unusable.
HANDSHAKE_WAIT_S = 60.0
# A request may queue behind a long backlog at the server; a server that stopped answering
# still fails it eventually (a dead one fails it at once: the connection drops).
REQUEST_TIMEOUT_S = 1800.0


class ServerMismatchError(ConfigError):
    """A server serves something other than the run froze (fatal: a retry meets the same)."""

    def __init__(self, url: str, problems: list[str], model_dir: Any) -> None:
        self.problems = problems
        super().__init__(
            f"engine.url {url} serves something other than this run needs: "
            + "; ".join(problems)
            + f" (server started from {model_dir}; start `hsx serve` with the run's settings, "
            "or set the run's to the server's)"
        )


def fetch_info(url: str, wait_s: float) -> dict[str, Any]:
    """The server's ``/hsx/info``, waiting up to ``wait_s`` for it to answer (it may still be
    loading the model, or restarting)."""
    deadline = time.monotonic() + wait_s
    last = "no answer"
    while True:
        try:
            health = httpx.get(f"{url}/health", timeout=10)
            if health.status_code == 200:
                response = httpx.get(f"{url}{INFO_PATH}", timeout=10)
                if response.status_code == 200:
                    info = dict(response.json())
                    if "instance" in info:
                        return info
                    last = f"{INFO_PATH} answered {response.text[:200]!r}"
                else:
                    last = (
                        f"{INFO_PATH}: HTTP {response.status_code} (is it an `hsx serve` server?)"
                    )
                    if response.status_code == 404:
                        raise ConfigError(
                            f"engine.url {url}: expected an `hsx serve` server, found "
                            f"a server without {INFO_PATH} (plain `vllm serve`?)"
                        )
            else:
                last = f"/health: HTTP {health.status_code}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        if time.monotonic() >= deadline:
            raise EngineError(
                f"engine.url {url}: expected an `hsx serve` server answering within "
                f"{wait_s:g} s (engine.server_wait_s), found {last}"
            )
        time.sleep(1.0)


class ServerEngine:
    """One server of ``engine.url``, with this process's channel to it."""

    def __init__(
        self,
        url: str,
        expected: dict[str, Any],
        hidden_size: int,
        ring_bytes: int,
        wait_s: float,
    ) -> None:
        self.url = url
        self.info = fetch_info(url, wait_s)
        problems = identity_problems(self.info, expected, url)
        if problems:
            raise ServerMismatchError(url, problems, self.info.get("model_dir"))
        self.instance = str(self.info["instance"])
        self.layer_ids = tuple(int(i) for i in self.info["layer_ids"])
        self.hidden_size = hidden_size
        self._model = str(self.info["served_model_name"])
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._channel = tempfile.mkdtemp(prefix=CHANNEL_PREFIX, dir=shm)
        self._granules = ring_granules(ring_bytes)
        self._rendezvous = ResultRendezvous(
            self._check,
            spool_dir=self._channel,
            ring_bytes=ring_bytes,
            spool_wait_limit_s=RESULT_WAIT_S,
        )
        self._failure: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.outstanding_tokens = 0  # submitted, not yet resolved: the pool's load measure
        self.requests_sent = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"hsx-server-client-{url}", daemon=True
        )
        self._thread.start()
        self._http = asyncio.run_coroutine_threadsafe(self._open_http(), self._loop).result()
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise
        # The server holds the ring and the FIFO open now: their names can go, so that a
        # client killed later leaves no ring in /dev/shm (freed with the last mapping).
        for name in (RING_FILE, READY_FIFO):
            (Path(self._channel) / name).unlink(missing_ok=True)
        logger.info(
            "server %s (instance %s, %s, layers %s) connected through %s",
            url,
            self.instance,
            self.info.get("model_dir"),
            list(self.layer_ids),
            self._channel,
        )

    async def _open_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
        )

    def _handshake(self) -> None:
        """One short prompt through the whole path: the server can open this channel, and its
        rows have the expected shape, are finite and are not all zero in any layer."""
        (future,) = self.submit([np.arange(4, dtype=np.int32)])
        try:
            rows = future.result(timeout=HANDSHAKE_WAIT_S)  # [4, K, H]
        except TimeoutError as exc:
            raise EngineError(
                f"server {self.url}: no states through {self._channel} within "
                f"{HANDSHAKE_WAIT_S:g} s of its answer: the server must run on this node, as the "
                "same user, and see this /dev/shm"
            ) from exc
        zero_layers = [
            layer
            for position, layer in enumerate(self.layer_ids)
            if not bool(rows[:, position].any())
        ]
        if not bool(torch.isfinite(rows).all()) or zero_layers:
            raise EngineError(
                f"server {self.url}: the handshake's states are not usable (finite: "
                f"{bool(torch.isfinite(rows).all())}, all-zero layer ids: {zero_layers})"
            )

    @property
    def alive(self) -> bool:
        return not self._closed and self._failure is None

    @property
    def failure(self) -> BaseException | None:
        """Why this client stopped being usable (its server died or restarted), if it did."""
        return self._failure

    def submit(self, prompts: Sequence[np.ndarray]) -> list[Future[torch.Tensor]]:
        """Queue prompts (token ids ``[tokens]``); each future gives ``[tokens, K, H]``."""
        if not self.alive:
            raise EngineError(
                f"server {self.url} is not usable ({self._failure!r}); a retry reconnects"
            )
        batch = uuid.uuid4().hex[:12]
        items = []
        for i, prompt in enumerate(prompts):
            future: Future[torch.Tensor] = Future()
            tokens = int(prompt.shape[0])
            with self._lock:
                self.outstanding_tokens += tokens
            future.add_done_callback(functools.partial(self._resolved, tokens))
            items.append((f"{batch}-{i}", prompt, future))
        asyncio.run_coroutine_threadsafe(self._send_all(items), self._loop)
        return [future for _, _, future in items]

    def extract(self, prompts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        return [future.result() for future in self.submit(prompts)]

    def _resolved(self, tokens: int, _future: Future[torch.Tensor]) -> None:
        with self._lock:
            self.outstanding_tokens -= tokens

    async def _send_all(self, items: list[tuple[str, np.ndarray, Future[torch.Tensor]]]) -> None:
        await asyncio.gather(*(self._send(*item) for item in items))

    async def _send(self, key: str, prompt: np.ndarray, future: Future[torch.Tensor]) -> None:
        ids = prompt.tolist()
        body = {
            "model": self._model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": ChannelRequest(self._channel, self._granules, key).to_params(),
        }
        try:
            response = await self._http.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            self._fail(
                future,
                EngineError(f"server {self.url}: request {key} of {len(ids)} tokens: {exc!r}"),
                dead=True,
            )
            return
        self.requests_sent += 1
        if response.status_code == 400:  # vLLM refused this prompt (too long, bad ids)
            self._fail(
                future,
                RequestRefusedError(
                    f"request {key} of {len(ids)} tokens: expected server {self.url} to accept it, "
                    f"found HTTP 400: {response.text[:500]}"
                ),
            )
            return
        if response.status_code != 200:
            self._fail(
                future,
                EngineError(
                    f"server {self.url}: request {key}: expected HTTP 200, found "
                    f"{response.status_code}: {response.text[:500]}"
                ),
                dead=response.status_code >= 500,
            )
            return
        reply = (response.json().get("kv_transfer_params") or {}).get(PARAMS_KEY)
        if not isinstance(reply, dict):
            self._fail(
                future,
                EngineError(
                    f"server {self.url}: request {key}: expected hsx's reply in kv_transfer_params, "
                    "found none (is hsx's connector loaded there?)"
                ),
                dead=True,
            )
            return
        if reply.get("instance") != self.instance:
            self._fail(
                future,
                EngineError(
                    f"server {self.url} restarted: expected instance {self.instance}, found "
                    f"{reply.get('instance')} (its rows went nowhere); a retry reconnects"
                ),
                dead=True,
            )
            return
        if reply.get("prompt_digest") != prompt_digest(prompt):
            future.set_exception(
                CapturedDataError(
                    f"request {key}: the server computed a prompt of {reply.get('prompt_tokens')} "
                    f"tokens (digest {reply.get('prompt_digest')}), expected the plan's "
                    f"{len(ids)} (digest {prompt_digest(prompt)})"
                )
            )
            future = Future()  # its rows still arrive: received and dropped
        self._rendezvous.expect(key, len(ids), future)

    def _fail(self, future: Future[torch.Tensor], error: BaseException, dead: bool = False) -> None:
        if dead and self._failure is None:
            self._failure = error
            logger.error("server %s: %r", self.url, error)
            # Answered requests whose rows had not come yet will not come from a dead server.
            self._rendezvous.fail_all(error)
        if not future.done():
            future.set_exception(error)

    def _check(self, key: str, expected_tokens: int, rows: torch.Tensor) -> torch.Tensor:
        expected = (expected_tokens, len(self.layer_ids), self.hidden_size)
        if tuple(rows.shape) != expected:
            raise EngineError(
                f"request {key} from {self.url}: expected hidden states of shape {expected}, "
                f"found {tuple(rows.shape)}"
            )
        return rows

    def describe(self) -> dict[str, Any]:
        """What a commit record keeps of the server that computed its chunk."""
        return {"url": self.url, "instance": self.instance, "host": self.info.get("host")}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._rendezvous.fail_all(EngineError(f"client of server {self.url} closed"))
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._http.aclose(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._rendezvous.close()
        shutil.rmtree(self._channel, ignore_errors=True)
