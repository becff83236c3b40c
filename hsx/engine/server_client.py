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

from hsx.engine.capture_checks import CapturedDataError
from hsx.engine.channel_files import write_secret
from hsx.engine.result_ring import READY_FIFO, RING_FILE, ring_granules
from hsx.engine.results import ResultRendezvous
from hsx.engine.server_protocol import (
    CHANNEL_PREFIX,
    INFO_PATH,
    PARAMS_KEY,
    ChannelRequest,
    authorization_header,
    identity_problems,
    prompt_digest,
)
from hsx.engine.shm_folders import make_owned_folder
from hsx.errors import ConfigError, EngineError, HsxError, RequestRefusedError
from settings import TimeoutSettings

logger = logging.getLogger(__name__)

# The waits are settings (``timeouts``): the rows of a request the server answered arrive within
# milliseconds through the ring, so a request still without rows after ``server_result_s`` was
# lost (the server died after answering); the handshake's rows must arrive within
# ``server_handshake_s`` or the channel is unusable; a request may queue behind a long backlog
# at the server, and one that stopped answering still fails after ``server_request_s`` (a dead
# one fails at once: the connection drops).


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


def key_refused(url: str, api_key: str | None, where: str) -> ConfigError:
    """A server answered 401: the run's key is missing or not the server's (fatal: a retry
    sends the same key)."""
    found = "none set" if not api_key else "a key the server refused"
    return ConfigError(
        f"engine.url {url}: {where} answered HTTP 401: expected engine.api_key "
        f"(HSX_ENGINE__API_KEY) to be the server's server.api_key, found {found}"
    )


def fetch_info(url: str, wait_s: float, api_key: str | None = None) -> dict[str, Any]:
    """The server's ``/hsx/info``, waiting up to ``wait_s`` for it to answer (it may still be
    loading the model, or restarting)."""
    deadline = time.monotonic() + wait_s
    last = "no answer"
    while True:
        try:
            health = httpx.get(f"{url}/health", timeout=10)
            if health.status_code == 200:
                response = httpx.get(
                    f"{url}{INFO_PATH}", timeout=10, headers=authorization_header(api_key)
                )
                if response.status_code == 401:
                    raise key_refused(url, api_key, INFO_PATH)
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


class _Batch:
    """The prompts of one completion request, by digest (identical prompts sent once)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.prompts: dict[str, np.ndarray] = {}
        self.futures: dict[str, list[Future[torch.Tensor]]] = {}

    @property
    def tokens(self) -> int:
        return sum(int(prompt.shape[0]) for prompt in self.prompts.values())

    def add(self, prompt: np.ndarray, future: Future[torch.Tensor]) -> None:
        digest = prompt_digest(prompt)
        self.prompts.setdefault(digest, prompt)
        self.futures.setdefault(digest, []).append(future)

    def split(self) -> list[_Batch]:
        singles: list[_Batch] = []
        for digest, prompt in self.prompts.items():
            single = _Batch(f"{self.key}-{len(singles)}")
            single.prompts[digest] = prompt
            single.futures[digest] = self.futures[digest]
            singles.append(single)
        return singles

    def fan_out(self, digest: str) -> Future[torch.Tensor]:
        """The future the rows resolve; it resolves every prompt of this digest."""
        waiting = self.futures[digest]
        if len(waiting) == 1:
            return waiting[0]
        first: Future[torch.Tensor] = Future()

        def resolve(done: Future[torch.Tensor]) -> None:
            error = done.exception()
            for future in waiting:
                if future.done():  # failed already (the client closed)
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(done.result())

        first.add_done_callback(resolve)
        return first


class ServerEngine:
    """One server of ``engine.url``, with this process's channel to it."""

    def __init__(
        self,
        url: str,
        expected: dict[str, Any],
        hidden_size: int,
        ring_bytes: int,
        wait_s: float,
        api_key: str | None = None,
        timeouts: TimeoutSettings | None = None,
    ) -> None:
        self.url = url
        self._api_key = api_key
        self._timeouts = timeouts or TimeoutSettings()
        self.info = fetch_info(url, wait_s, api_key)
        problems = identity_problems(self.info, expected, url)
        if problems:
            raise ServerMismatchError(url, problems, self.info.get("model_dir"))
        self.instance = str(self.info["instance"])
        self.layer_ids = tuple(int(i) for i in self.info["layer_ids"])
        self.hidden_size = hidden_size
        self._model = str(self.info["served_model_name"])
        self._channel = make_owned_folder(CHANNEL_PREFIX)
        # The channel is this client's alone: the server writes into it only for requests that
        # carry the secret written here (readable by this user alone).
        self._secret = write_secret(self._channel)
        self._granules = ring_granules(ring_bytes)
        self._rendezvous = ResultRendezvous(
            self._check,
            spool_dir=self._channel,
            ring_bytes=ring_bytes,
            spool_wait_limit_s=self._timeouts.server_result_s,
        )
        self._failure: BaseException | None = None
        self._closed = False
        # Batches submitted whose answer has not been handled: failed by close(), whose stop of
        # the event loop would leave their futures unresolved forever.
        self._pending: set[_Batch] = set()
        self._lock = threading.Lock()
        self.outstanding_tokens = 0  # submitted, not yet resolved: the pool's load measure
        self.chunks = 0  # work chunks the pool gave this server and not released yet
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
            headers=authorization_header(self._api_key),
            timeout=httpx.Timeout(self._timeouts.server_request_s, connect=10.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
        )

    def _handshake(self) -> None:
        """One short prompt through the whole path: the server can open this channel, and its
        rows have the expected shape, are finite and are not all zero in any layer."""
        (future,) = self.submit([np.arange(4, dtype=np.int32)])
        try:
            rows = future.result(timeout=self._timeouts.server_handshake_s)  # [4, K, H]
        except TimeoutError as exc:
            raise EngineError(
                f"server {self.url}: no states through {self._channel} within "
                f"{self._timeouts.server_handshake_s:g} s (timeouts.server_handshake_s) of its answer: the server must run on this node, as the "
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

    def submit(
        self, prompts: Sequence[np.ndarray], state_encoding: str = ""
    ) -> list[Future[torch.Tensor]]:
        """Queue prompts (token ids ``[tokens]``); each future gives ``[tokens, K, H]`` (states
        as the server's engine holds them, whatever ``state_encoding``: the writer quantizes).

        The prompts go as one completion request (a list of prompts: one HTTP request per batch
        measured 3.5x the tokens/s of one per prompt through vLLM's server on the tiny Llama).
        The server's connector keys each prompt's rows by this batch's key and the digest of
        the prompt it computed, so rows reach the prompt the engine really ran; identical
        prompts of a batch are sent once and share their rows."""
        if not self.alive:
            raise EngineError(
                f"server {self.url} is not usable ({self._failure!r}); a retry reconnects"
            )
        batch = _Batch(uuid.uuid4().hex[:12])
        with self._lock:
            if self._closed:
                raise EngineError(f"client of server {self.url} closed; a retry reconnects")
            self._pending.add(batch)
        futures: list[Future[torch.Tensor]] = []
        for prompt in prompts:
            future: Future[torch.Tensor] = Future()
            tokens = int(prompt.shape[0])
            with self._lock:
                self.outstanding_tokens += tokens
            future.add_done_callback(functools.partial(self._resolved, tokens))
            batch.add(prompt, future)
            futures.append(future)
        asyncio.run_coroutine_threadsafe(self._send_tracked(batch), self._loop)
        return futures

    async def _send_tracked(self, batch: _Batch) -> None:
        try:
            await self._send(batch)
        finally:
            with self._lock:
                self._pending.discard(batch)

    def extract(self, prompts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        return [future.result() for future in self.submit(prompts)]

    def _resolved(self, tokens: int, _future: Future[torch.Tensor]) -> None:
        with self._lock:
            self.outstanding_tokens -= tokens

    async def _send(self, batch: _Batch) -> None:
        what = f"batch {batch.key} of {len(batch.prompts)} prompts, {batch.tokens} tokens"
        body = {
            "model": self._model,
            "prompt": [prompt.tolist() for prompt in batch.prompts.values()],
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": ChannelRequest(
                channel=self._channel, granules=self._granules, key=batch.key, secret=self._secret
            ).to_params(),
        }
        try:
            response = await self._http.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            self._fail(batch, EngineError(f"server {self.url}: {what}: {exc!r}"), dead=True)
            return
        self.requests_sent += 1
        if response.status_code == 400 and len(batch.prompts) > 1:
            # vLLM refused a prompt of the batch (too long, ids outside the vocabulary): each
            # prompt again on its own, so that only the refused one fails, as in-process.
            await asyncio.gather(*(self._send(single) for single in batch.split()))
            return
        if response.status_code == 401:
            self._fail(batch, key_refused(self.url, self._api_key, "/v1/completions"), dead=True)
            return
        if response.status_code == 403:
            # The server refused this client's own channel (gone, or not as it was made): no
            # request of this client can be extracted; a retry reconnects with a new channel.
            self._fail(
                batch,
                EngineError(
                    f"server {self.url}: {what}: expected it to write into channel "
                    f"{self._channel}, found it refused (HTTP 403): {response.text[:500]}"
                ),
                dead=True,
            )
            return
        if response.status_code == 400:
            self._fail(
                batch,
                RequestRefusedError(
                    f"request of {batch.tokens} tokens: expected server {self.url} to accept it, "
                    f"found HTTP 400: {response.text[:500]}"
                ),
            )
            return
        if response.status_code != 200:
            self._fail(
                batch,
                EngineError(
                    f"server {self.url}: {what}: expected HTTP 200, found "
                    f"{response.status_code}: {response.text[:500]}"
                ),
                dead=response.status_code >= 500,
            )
            return
        problem = self._reply_problem(batch, response.json())
        if problem is not None:
            self._fail(batch, problem, dead=True)
            return
        for digest, prompt in batch.prompts.items():
            self._rendezvous.expect(
                f"{batch.key}:{digest}", int(prompt.shape[0]), batch.fan_out(digest)
            )

    def _reply_problem(self, batch: _Batch, answer: dict[str, Any]) -> HsxError | None:
        """What is wrong with a completion's answer: no hsx reply (no hsx connector there),
        another server instance (it restarted: the rows went to nobody), or another prompt
        computed than sent (the engine's count of prompt tokens)."""
        reply = (answer.get("kv_transfer_params") or {}).get(PARAMS_KEY)
        if not isinstance(reply, dict):
            return EngineError(
                f"server {self.url}: batch {batch.key}: expected hsx's reply in "
                "kv_transfer_params, found none (is hsx's connector loaded there?)"
            )
        if reply.get("instance") != self.instance:
            return EngineError(
                f"server {self.url} restarted: expected instance {self.instance}, found "
                f"{reply.get('instance')} (its rows went nowhere); a retry reconnects"
            )
        computed = (answer.get("usage") or {}).get("prompt_tokens")
        if computed != batch.tokens or reply.get("prompt_digest") not in batch.prompts:
            return CapturedDataError(
                f"server {self.url}: batch {batch.key}: the engine computed {computed} prompt "
                f"tokens (first prompt digest {reply.get('prompt_digest')}), expected the "
                f"plan's {batch.tokens} in {len(batch.prompts)} prompts"
            )
        return None

    def _fail(self, batch: _Batch, error: BaseException, dead: bool = False) -> None:
        if self._closed:
            # close() cut the request (its HTTP client went first): say so, not what the cut
            # request saw, and do not take the server for dead.
            error, dead = EngineError(f"client of server {self.url} closed ({error!r})"), False
        if dead and self._failure is None:
            self._failure = error
            logger.error("server %s: %r", self.url, error)
            # Answered requests whose rows had not come yet will not come from a dead server.
            self._rendezvous.fail_all(error)
        for futures in batch.futures.values():
            for future in futures:
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
        with self._lock:
            if self._closed:
                return
            self._closed = True
        closed = EngineError(f"client of server {self.url} closed ({self._failure!r})")
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._http.aclose(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        # The loop has stopped: nothing registers with the rendezvous any more.
        self._rendezvous.fail_all(closed)
        with self._lock:
            unanswered, self._pending = list(self._pending), set()
        for batch in unanswered:
            for futures in batch.futures.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(closed)
        self._rendezvous.close()
        _remove_channel(self._channel)


def _remove_channel(channel: str, patience_s: float = 5.0) -> None:
    """Remove a closed client's channel folder. The server may still be writing the spool
    file of a request the client gave up on, so an rmtree can race with it ("directory not
    empty"): try again until the folder is gone or ``patience_s`` has passed."""
    deadline = time.monotonic() + patience_s
    while True:
        shutil.rmtree(channel, ignore_errors=True)
        if not os.path.lexists(channel) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if os.path.lexists(channel):
        logger.warning(
            "client channel %s could not be removed; the next process removes it", channel
        )
