"""hsx's KV connector for vLLM's ``extract_hidden_states`` speculative method.

vLLM's ``extract_hidden_states`` drafter stores each token's aux hidden states ``[K, H]`` in the
KV cache of one cache-only attention layer; a KV connector takes them out. vLLM's stock
ExampleHiddenStatesConnector cannot run on CPU (CUDA streams, pinned memory) and copies a request
out one engine step *after* it finishes, which hangs an in-process engine whose caller stops
stepping once the outputs are returned. This connector instead copies a request's rows in the very
step whose forward completes its prompt (``wait_for_save`` runs after the drafter wrote the cache),
so every result exists before the engine returns the request, in-process or not, and the request's
blocks are freed at once.

Results go to a *sink*: in-process, a callable registered under ``sink_id`` (no copy across
processes); otherwise (engine core in its own process) the shared-memory result ring that hsx
created in the spool directory (hsx.engine.result_ring), and a spool file per request when the
ring is full.

Under ``hsx serve`` (vLLM's own API server) each client names its own ring, its *channel*, in
the request's ``kv_transfer_params`` (``{"hsx": {"channel", "granules", "key"}}``); the rows go
there under the client's key, and the request's response carries the server's identity and a
digest of the prompt the engine computed (``request_finished``). A client that went away costs
its channel, never the server: every write to a channel is non-blocking and its failure drops
that channel alone.

Nothing a request sends can stop the engine: its kv_transfer_params pass hsx's schema here too
(the API server's guard refused what fails it already), a channel is opened only with the
secret its client wrote into it, and any failure of a request's channel (refused, full, a
reader gone or stalled) costs that request or that channel, logged with what the request sent
escaped and cut (hsx.engine.log_safety).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

import contextlib
import hmac

from hsx import timings
from hsx.engine.channel_files import ChannelOwnershipError, OwnerRule
from hsx.engine.copier import DeviceToHostCopier, gather_rows_on_cpu, write_spool_file
from hsx.engine.log_safety import shown
from hsx.engine.options import CONNECTOR_NAME
from hsx.engine.platform import request_amx
from hsx.engine.result_ring import ChannelClosedError, ChannelFullError, RingWriter
from hsx.engine.server_protocol import (
    PARAMS_KEY,
    SERVER_INSTANCE_ENV,
    ChannelRequest,
    RequestParamsError,
    TransferParams,
    prompt_digest,
)
from hsx.engine.vllm_compat import HIDDEN_STATE_LAYOUT, TOKENS_FIRST, hidden_state_cache_order
from hsx.store.fp8_states import ENCODING as FP8_ENCODING
from hsx.store.fp8_states import PACKED_SCALE_BYTES
from hsx.store.fp8_states import pack as packed_fp8

logger = logging.getLogger(__name__)

# Channels a server holds open at once (each holds its folder, its FIFO and its ring's mapping):
# beyond it, those whose client is gone are dropped first, then a new one is refused.
MAX_CHANNELS = 256

# vLLM imports this module in the engine core's own process too (engine.in_process=False):
# ask Linux for AMX there before the model's first kernel runs.
request_amx()

# Sinks registered in this process: sink_id -> callable(key, hidden_states [tokens, K, H], or
# the error that kept them from arriving).
HiddenStateSink = Callable[[str, "torch.Tensor | BaseException"], None]
_SINKS: dict[str, HiddenStateSink] = {}
_SINKS_LOCK = threading.Lock()


def register_sink(sink_id: str, sink: HiddenStateSink) -> None:
    with _SINKS_LOCK:
        _SINKS[sink_id] = sink


def unregister_sink(sink_id: str) -> None:
    with _SINKS_LOCK:
        _SINKS.pop(sink_id, None)


@dataclass
class ExtractionJob:
    """One request whose prompt completes in this step: copy its rows out of the cache."""

    key: str
    block_ids: list[int]
    num_tokens: int
    # Set for a request of an hsx server's client: where its rows go, and under which key.
    channel: ChannelRequest | None = None
    # fp8_e4m3: quantized on the GPU and delivered packed (kv_transfer_params ENCODING_PARAM).
    encoding: str = ""


@dataclass
class HsxConnectorMetadata(KVConnectorMetadata):
    jobs: list[ExtractionJob] = field(default_factory=list)


@dataclass
class _TrackedRequest:
    key: str
    prompt_len: int
    block_ids: list[int]
    emitted: bool = False


def _hidden_state_group_id(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV cache group of the cache-only (hidden-state) layer."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise RuntimeError(
        f"expected exactly one hidden-state KV cache group, found {len(ids)} among "
        f"{len(groups)} groups ({[type(g.kv_cache_spec).__name__ for g in groups]})"
    )


class HsxHiddenStatesConnector(KVConnectorBase_V1):
    """Store-only connector: hands each finished prompt's hidden states to hsx's sink."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.speculative_config is None:
            raise RuntimeError(
                f"{CONNECTOR_NAME} needs speculative method 'extract_hidden_states', "
                "found no speculative_config"
            )
        if vllm_config.cache_config.enable_prefix_caching:
            # A prefix-cache hit skips the forward of repeated tokens: their states would be missing.
            raise RuntimeError(f"{CONNECTOR_NAME} needs enable_prefix_caching=False, found True")
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._sink_id: str = str(extra.get("sink_id", ""))
        self._spool_dir: str = str(extra.get("spool_dir", ""))
        self._ring_granules = int(extra.get("ring_granules", 0))
        # Under hsx serve: only requests that name a channel are extracted; any other (a plain
        # completion, a health probe) runs as vLLM would run it.
        self._serving = bool(extra.get("serving", False))
        # Whose channel folders this server writes into: its own user's, and those of the
        # groups `hsx serve` allows (server.channel_groups).
        self._channel_owners = OwnerRule.of_this_process(extra.get("channel_gids", ()))
        self._group_id = _hidden_state_group_id(kv_cache_config)
        # Scheduler side: requests seen so far, by vLLM request id.
        self._tracked: dict[str, _TrackedRequest] = {}
        # Scheduler side, under hsx serve: the client's channel of each request, by vLLM id.
        self._channel_requests: dict[str, ChannelRequest] = {}
        # Scheduler side: requests whose rows are delivered encoded (fp8_e4m3), by vLLM id.
        self._encodings: dict[str, str] = {}
        self._instance = os.environ.get(SERVER_INSTANCE_ENV, "")
        # Worker side.
        self._kv_cache: torch.Tensor | None = None  # [blocks, block_size, K, H] view
        self._copier: DeviceToHostCopier | None = None  # CUDA only
        self._ring: RingWriter | None = None  # engine in its own process: rows go here
        self._is_writer_rank = True
        self._channels: dict[str, RingWriter] = {}  # channel folder -> its ring (hsx serve)
        # Channels given up (refused after their secret matched, a reader gone or stalled):
        # never opened again, so that a stalled client costs the server's steps one wait.
        self._broken_channels: set[str] = set()
        # vLLM request id -> (the client's ring, the client's key), until delivered
        self._routes: dict[str, tuple[RingWriter, str]] = {}
        # Channels and routes change in the engine's step and, on GPUs, in the copier's thread.
        self._channels_lock = threading.Lock()

    # ---- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        # Every TP rank holds the same hidden states; one writer is enough.
        self._is_writer_rank = get_tensor_model_parallel_rank() == 0
        layers = get_layers_from_vllm_config(
            self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches.keys())
        )
        if len(layers) != 1:
            raise RuntimeError(
                f"expected 1 cache-only attention layer, found {len(layers)}: {sorted(layers)}"
            )
        cache = kv_caches[next(iter(layers))]
        order = hidden_state_cache_order()
        by_token = cache if order == TOKENS_FIRST else cache.transpose(1, 2)
        if cache.dim() != 4:
            raise RuntimeError(
                f"hidden-state cache: expected 4 axes [{order}], found shape {tuple(cache.shape)}"
            )
        self._kv_cache = by_token  # [blocks, block_size, K, H] (a view)
        if self._is_writer_rank and self._ring_granules and self._spool_dir:
            self._ring = RingWriter(self._spool_dir, self._ring_granules)
        if cache.device.type == "cuda":
            self._copier = DeviceToHostCopier(cache.device, self._deliver)
            if self._ring is not None:
                self._ring.pin()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # store-only: nothing to load

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the drafter already wrote the cache; rows are copied in wait_for_save

    def wait_for_save(self) -> None:
        # Runs after the drafter's forward of this step (vLLM defers it under spec decode).
        if not self._is_writer_rank or not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, HsxConnectorMetadata) or not metadata.jobs:
            return
        if self._kv_cache is None:
            raise RuntimeError("hidden-state cache not registered before the first save")
        jobs, rings = [], []
        for job in metadata.jobs:
            ring = self._ring_of(job)
            if job.channel is not None and ring is None:
                continue  # its client's channel cannot be opened: nowhere to deliver
            jobs.append(job)
            rings.append(ring)
        if not jobs:
            return
        if self._copier is not None:
            # GPU: per encoding (plain, or fp8 packed), one gather and one asynchronous copy.
            for encoding in sorted({job.encoding for job in jobs}):
                group = [(j, r) for j, r in zip(jobs, rings, strict=True) if j.encoding == encoding]
                self._copy_from_gpu([j for j, _ in group], [r for _, r in group], encoding)
            return
        index, row_starts = self._block_index(jobs)
        _, block_size, layers, hidden = self._kv_cache.shape
        dtype = self._kv_cache.dtype
        if all(ring is None for ring in rings):
            rows = gather_rows_on_cpu(self._kv_cache, index)
            for job, start in zip(jobs, row_starts, strict=True):
                self._deliver(job.key, rows[start : start + job.num_tokens])
            return
        # CPU, engine in another process: each request's blocks straight into its ring place.
        for job, start, ring in zip(jobs, row_starts, rings, strict=True):
            blocks = index[start // block_size : (start + job.num_tokens - 1) // block_size + 1]
            shape = (blocks.numel(), block_size, layers, hidden)
            place = ring.allocate(shape, dtype) if ring is not None else None
            rows = gather_rows_on_cpu(self._kv_cache, blocks, out=place)
            self._deliver(job.key, rows[: job.num_tokens])

    def _copy_from_gpu(
        self, jobs: list[ExtractionJob], rings: list[RingWriter | None], encoding: str
    ) -> None:
        """Gather on the device, copy to pinned memory on a side stream (straight into the
        result ring where it is pinned), deliver from the copier's thread: the engine step
        never waits for the copy. fp8 jobs are quantized on the device and delivered packed."""
        if self._kv_cache is None or self._copier is None:
            raise RuntimeError("hidden-state cache not registered before the first save")
        index, row_starts = self._block_index(jobs)
        _, _, layers, hidden = self._kv_cache.shape
        dtype = self._kv_cache.dtype
        packed = encoding == FP8_ENCODING
        if packed:
            hidden, dtype = hidden + PACKED_SCALE_BYTES, torch.uint8
        destinations = None
        if any(ring is not None and ring.pinned for ring in rings):
            destinations = [
                ring.allocate((job.num_tokens, layers, hidden), dtype)
                if ring is not None and ring.pinned
                else None
                for job, ring in zip(jobs, rings, strict=True)
            ]
        encode = packed_fp8 if packed else None
        self._copier.submit(self._kv_cache, index, jobs, row_starts, destinations, encode)

    def _ring_of(self, job: ExtractionJob) -> RingWriter | None:
        """The ring a job's rows go to: its client's channel (hsx serve; routed by vLLM's
        request id until delivered), else the ring of the hsx process that built this engine.
        None for a channel the request may not or cannot use: that request is not extracted."""
        if job.channel is None:
            return self._ring
        request = job.channel
        folder = request.channel
        with self._channels_lock:
            ring = self._channels.get(folder)
        if ring is not None and not hmac.compare_digest(
            (ring.secret or "").encode(), request.secret.encode()
        ):
            logger.error(
                "request %s names channel %s without its secret: not extracted",
                shown(job.key),
                shown(folder),
            )
            return None
        if ring is None:
            ring = self._open_channel(request)
            if ring is None:
                return None
        with self._channels_lock:
            self._routes[job.key] = (ring, request.key)
        return ring

    def _open_channel(self, request: ChannelRequest) -> RingWriter | None:
        folder = request.channel
        if folder in self._broken_channels:
            return None
        if len(self._channels) >= MAX_CHANNELS:
            self._drop_dead_channels()
        if len(self._channels) >= MAX_CHANNELS:
            logger.error(
                "hsx channel %s refused: expected at most %d open channels, found %d",
                shown(folder),
                MAX_CHANNELS,
                len(self._channels),
            )
            return None
        try:
            # Non-blocking: a client that went away must never stall the server's step.
            ring = RingWriter(
                folder,
                request.granules,
                nonblocking=True,
                owners=self._channel_owners,
                secret=request.secret,
            )
        except ChannelOwnershipError as exc:
            # Not this request's channel (or gone): refused, and the channel stays usable by
            # its own client (a request without the secret must not break it).
            logger.error("hsx channel %s refused: %s", shown(folder), shown(str(exc), 400))
            return None
        except Exception as exc:  # whatever the folder holds: its request alone fails
            # Its rows cannot be delivered: the client's wait for them runs out and names the
            # channel; other clients go on.
            self._broken_channels.add(folder)
            logger.error(
                "hsx channel %s cannot be opened: %s", shown(folder), shown(repr(exc), 400)
            )
            return None
        self._drop_dead_channels()
        if self._copier is not None:
            ring.pin()
        with self._channels_lock:
            self._channels[folder] = ring
        return ring

    def _drop_dead_channels(self) -> None:
        """Forget channels whose client is gone (each kept its ring mapped here)."""
        with self._channels_lock:
            rings = list(self._channels.items())
        for folder, ring in rings:
            if not ring.reader_alive():
                self._close_channel(folder, gone=True)

    def _close_channel(self, folder: str, gone: bool = False) -> None:
        """Close a channel; ``gone`` (its reader went away or stopped reading): never open it
        again, and remove the spool files it left unread. Routes of its requests still in
        flight stay: their delivery finds the ring closed and writes nothing."""
        with self._channels_lock:
            ring = self._channels.pop(folder, None)
            if gone:
                self._broken_channels.add(folder)
        if ring is not None:
            with contextlib.suppress(OSError):
                ring.close(remove_unread=gone)

    def _block_index(self, jobs: list[ExtractionJob]) -> tuple[torch.Tensor, list[int]]:
        """The blocks of every request completing in this step, in token order, and where each
        request's rows start in the gathered buffer (each on a block boundary)."""
        if self._kv_cache is None:
            raise RuntimeError("hidden-state cache not registered before the first save")
        block_size = self._kv_cache.shape[1]
        block_ids: list[int] = []
        starts: list[int] = []
        for job in jobs:
            needed = -(-job.num_tokens // block_size)
            if len(job.block_ids) < needed:
                raise RuntimeError(
                    f"request {job.key}: expected {needed} blocks of {block_size} for "
                    f"{job.num_tokens} tokens, found {len(job.block_ids)}"
                )
            starts.append(len(block_ids) * block_size)
            block_ids.extend(job.block_ids[:needed])
        index = torch.tensor(block_ids, dtype=torch.long).to(
            self._kv_cache.device, non_blocking=True
        )
        return index, starts

    def _deliver(self, key: str, rows: torch.Tensor | BaseException) -> None:
        with self._channels_lock:
            route = self._routes.pop(key, None)
        if route is not None:  # a client of hsx serve: its failure is its own
            ring, reply_key = route
            try:
                self._announce(ring, reply_key, rows)
            except ChannelClosedError:
                return  # given up already (said once, when it was)
            except Exception as exc:  # a channel that fails costs that channel alone
                logger.warning(
                    "hsx channel %s: client gone or not reading (%s); channel dropped",
                    shown(ring.folder),
                    shown(repr(exc), 400),
                )
                self._close_channel(ring.folder, gone=True)
            return
        if self._serving:
            # Under hsx serve every extracted request has a route (build_connector_meta skips
            # the others): nowhere to deliver, and never a reason to stop the engine.
            logger.warning("request %s: no channel to deliver to; rows dropped", shown(key))
            return
        with _SINKS_LOCK:
            sink = _SINKS.get(self._sink_id)
        if sink is not None:
            sink(key, rows)
            return
        if self._ring is None:
            raise RuntimeError(
                f"request {key}: no in-process sink {self._sink_id!r} and no result ring "
                f"(spool_dir {self._spool_dir!r}, ring_granules {self._ring_granules})"
            )
        self._announce(self._ring, key, rows)

    def _announce(self, ring: RingWriter, key: str, rows: torch.Tensor | BaseException) -> None:
        if ring is self._ring:
            self._announce_in(ring, key, rows)
            return
        # A client's channel: held open for the whole delivery (ChannelClosedError once given
        # up), so that no spool file is made through a folder descriptor closed meanwhile.
        with ring.in_use():
            self._announce_in(ring, key, rows)

    def _announce_in(self, ring: RingWriter, key: str, rows: torch.Tensor | BaseException) -> None:
        if isinstance(rows, BaseException):
            ring.announce_error(key, rows)
        elif ring.owns(rows):
            ring.announce_rows(key, rows)
        else:  # the ring was full when this request's rows were copied
            nbytes = rows.nbytes
            if ring is not self._ring:
                try:
                    ring.spool_room(nbytes)
                except ChannelFullError as exc:
                    # A client behind by a whole ring: this request fails (its client hears
                    # why); the channel goes on, and is given up once its FIFO is full too.
                    ring.announce_error(key, exc)
                    return
            with timings.timed("spool_write", nbytes):
                path = write_spool_file(ring.folder, key, rows, ring.folder_fd)
            if ring is not self._ring:
                ring.spooled(path.name, nbytes)  # counted until its client reads it
            ring.announce_file(key, str(path))

    def shutdown(self) -> None:
        # vLLM calls this where it has the hook (0.3x): the last stage timings go to hsx.
        if self._copier is not None:
            self._copier.close()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        for folder in list(self._channels):
            self._close_channel(folder)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    # ---- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        # Called for every request the scheduler admits, before build_connector_meta: the only
        # place the scheduler side sees the request's kv_transfer_params (hsx serve's channel).
        transfer = getattr(request, "kv_transfer_params", None)
        if transfer is None or request.request_id in self._channel_requests:
            return
        try:
            params = TransferParams.of(transfer)
            if params.hsx_state_encoding == FP8_ENCODING:
                self._encodings[request.request_id] = FP8_ENCODING
            if params.hsx is None:
                return
            # The prompts of one completion share its parameters: each prompt's rows go under
            # the client's batch key and the digest of the prompt this engine runs, which the
            # client matches with the prompts it sent (vLLM's request ids are not the client's
            # to parse).
            digest = prompt_digest(request.prompt_token_ids or [])
        except Exception as exc:  # whatever a request sent: computed, not extracted; never fatal
            said = str(exc) if isinstance(exc, RequestParamsError) else shown(repr(exc), 400)
            logger.error("request %s: not extracted: %s", shown(request.request_id), said)
            return
        self._channel_requests[request.request_id] = params.hsx.model_copy(
            update={"key": f"{params.hsx.key}:{digest}"}
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HsxConnectorMetadata()
        computed_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            # Results are keyed by the engine's request id (what add_request returned).
            prompt_len = len(new.prompt_token_ids or [])
            self._tracked[new.req_id] = _TrackedRequest(
                key=new.req_id,
                prompt_len=prompt_len,
                block_ids=list(new.block_ids[self._group_id]),
            )
            computed_before[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_blocks is not None:
                # A preempted request restarts with a fresh block table.
                tracked.block_ids = list(new_blocks[self._group_id])
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[self._group_id])
            computed_before[req_id] = cached.num_computed_tokens[i]
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.emitted or req_id not in computed_before:
                continue
            if computed_before[req_id] + scheduled >= tracked.prompt_len:
                channel = self._channel_requests.get(req_id)
                tracked.emitted = True
                if channel is None and self._serving:
                    continue
                meta.jobs.append(
                    ExtractionJob(
                        tracked.key,
                        list(tracked.block_ids),
                        tracked.prompt_len,
                        channel,
                        self._encodings.pop(req_id, ""),
                    )
                )
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Rows were copied in the step that completed the prompt: free the blocks now.
        self._tracked.pop(request.request_id, None)
        self._encodings.pop(request.request_id, None)  # one aborted before its prompt ended
        if self._channel_requests.pop(request.request_id, None) is None:
            return False, None
        # Back to the client in the response: which server computed it, and what it computed.
        try:
            digest = prompt_digest(request.prompt_token_ids or [])
        except Exception as exc:  # never fatal; the client sees no digest it sent
            digest = f"none ({shown(repr(exc))})"
        reply = {
            "instance": self._instance,
            "pid": os.getpid(),
            "prompt_tokens": len(request.prompt_token_ids or []),
            "prompt_digest": digest,
        }
        return False, {PARAMS_KEY: reply}

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Token-major (one token's K states together); a name 0.26 and 0.3x both know.
        return HIDDEN_STATE_LAYOUT
