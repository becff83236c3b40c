"""hsx's whole configuration: one pydantic-settings model per section, every field documented
and bounded. Built once at the entry point (CLI, flow) and passed down; never read at import time.

Environment variables use the ``HSX_`` prefix and ``__`` between sections, e.g.
``HSX_ENGINE__DTYPE=float32`` or ``HSX_LAYOUT__ROWS_PER_CHUNK=512``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from settings.strict import StrictSection, refuse_unknown_keys, unknown_keys_message

EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]
StoreDtype = Literal["auto", "float32", "bfloat16", "fp8_e4m3"]
LayerConvention = Literal["vllm", "specforge"]


def url_or_path(value: Any) -> Any:
    """A dataset location: a URL stays text (a Path would fold "s3://b" into "s3:/b"); any
    other text is a path."""
    if isinstance(value, str) and "://" not in value:
        return Path(value)
    return value


DatasetLocation = Annotated[Path | str, BeforeValidator(url_or_path)]


class EngineSettings(StrictSection):
    """How the vLLM engine is built, and how hsx feeds it. Engines are cached per process keyed
    by the fields that build one (``build_identity``): a changed batch size or server list
    reuses a loaded engine (18 minutes of load for Kimi-K2.5)."""

    SECTION: ClassVar[str] = "engine"
    # How hsx feeds an engine or reaches servers: not read when an engine is built.
    FEEDING_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"batch_tokens", "url", "server_wait_s", "api_key"}
    )

    dtype: EngineDtype = Field(
        "auto",
        description="Compute dtype. 'auto' = the checkpoint's dtype; float32 for bit-level "
        "comparisons with HF transformers. vLLM's DeepSeek models refuse float16.",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=4_194_304,
        description="vLLM's max_model_len: the longest sample it accepts is one token shorter "
        "(it samples one token after each prompt). None = the model's own limit, derived from "
        "config.json as vLLM derives it (max positions, RoPE scaling); a larger value fails "
        "in preflight.",
    )
    kv_cache_memory_gib: float | None = Field(
        None,
        gt=0,
        le=4096,
        description="KV cache size in GiB. None = on GPUs vLLM's own sizing (what "
        "gpu_memory_utilization leaves after the weights); on CPUs room for two sequences of "
        "max_model_len tokens, at least 1 GiB (vLLM's CPU build would ask for most of RAM).",
    )
    max_num_batched_tokens: int = Field(
        8192, ge=16, le=1_048_576, description="Tokens per engine step (chunked prefill size)."
    )
    max_num_seqs: int = Field(
        256,
        ge=1,
        le=4096,
        description="Requests per engine step. Extraction is prefill only: a step is bounded by "
        "max_num_batched_tokens, and a low cap leaves steps of short conversations part empty "
        "(measured with 64: steps of ~5.5k tokens of 8192, 2% slower extraction).",
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per engine.")
    enforce_eager: bool = Field(
        True, description="Skip torch.compile/CUDA graphs: faster start, slower steps."
    )
    in_process: bool = Field(
        True,
        description="Run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): "
        "2-3 s start on CPU and hidden states handed over without a copy. False runs it in a "
        "child process (vLLM's default, and what tensor_parallel_size > 1 needs) and hands "
        "results over through a shared-memory ring.",
    )
    result_ring_gib: float | None = Field(
        None,
        gt=0,
        le=1024,
        description="Shared memory (in /dev/shm) through which an engine in a child process "
        "hands hidden states over; a request that finds it full goes through a file (slower). "
        "None = 1/16 of the machine's memory, 0.25-16 GiB, at most a quarter of /dev/shm's free "
        "space. On a GPU it is registered as pinned memory.",
    )
    mla_rotary_custom_op: Literal["auto", "on", "off"] = Field(
        "auto",
        description="vLLM's custom rotary op. 'auto' turns it off for MLA models on CPU, where the "
        "CPU kernel is wrong for 3-D queries (measured 2.5e-2 error against HF, 1e-7 off).",
    )
    attention_backend: str = Field(
        "auto",
        pattern=r"^(auto|[A-Z][A-Z0-9_]*)$",
        description="vLLM attention backend. 'auto' lets hsx choose one that supports the dtype "
        "on this machine: on CPUs with AMX, vLLM's AMX MLA backend refuses float32, so float32 "
        "MLA models get CPU_MLA there; otherwise vLLM's own choice. A name (CPU_MLA, AMX_MLA, "
        "FLASH_ATTN, ...) forces that backend; preflight refuses a combination that cannot run.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of each GPU's memory the engine may take (vLLM's "
        "gpu_memory_utilization). None = vLLM's default (0.9). Lower it to run several engines "
        "on one GPU (two `hsx serve`, or a server beside a run's own engine): vLLM refuses to "
        "start when less than this fraction of the GPU is free.",
    )
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto", description="'dummy' = random weights (the preflight probe)."
    )
    seed: int = Field(0, ge=0, description="Engine seed.")
    batch_tokens: int = Field(
        4096,
        ge=16,
        le=16_777_216,
        description="Prompt tokens per batch a chunk queues at the engine (up to three batches "
        "queued per chunk). Bounds host memory: a batch's hidden states are held until written. "
        "Raise it on GPUs (e.g. 65536).",
    )
    url: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="URLs of running `hsx serve` servers (comma-separated in HSX_ENGINE__URL). "
        "Empty = hsx builds the engine itself. Set: chunks are sent to these servers (each "
        "chunk to one, the least loaded) and states come back through shared memory, so the "
        "servers must run on this node; the model folder is still read here (config, "
        "tokenizer) and must be the one they serve, as preflight checks.",
    )
    server_wait_s: float = Field(
        120.0,
        ge=0,
        le=86_400,
        description="How long a chunk waits for a server of engine.url to answer (down, "
        "restarting, still loading) before it fails.",
    )

    api_key: SecretStr | None = Field(
        None,
        exclude=True,  # never in a dump: Prefect's parameters, run records, logs
        description="The key of the `hsx serve` servers of engine.url (their server.api_key), "
        "sent as a bearer token. Set it in the environment (HSX_ENGINE__API_KEY), never in a "
        "deployment's parameters: it is left out of every record hsx and Prefect keep.",
    )

    def build_identity(self) -> dict[str, Any]:
        """The fields that build an engine, as JSON values: an engine cache's key."""
        return self.model_dump(mode="json", exclude=set(self.FEEDING_FIELDS))

    @field_validator("url", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("url")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"engine.url: expected http://HOST:PORT of an `hsx serve` server, found {url!r}"
                )
        if len(set(value)) != len(value):
            raise ValueError(f"engine.url: expected distinct servers, found {value}")
        return [url.rstrip("/") for url in value]


class CaptureSettings(StrictSection):
    """Which hidden states are captured and how they are stored."""

    SECTION: ClassVar[str] = "capture"

    layer_ids: list[int] | None = Field(
        None,
        description="Layer ids to capture. None = EAGLE-3 default (2, L//2, L-3) plus L. In vLLM's "
        "convention id k is the residual stream entering decoder layer k and id L the final "
        "pre-norm state.",
    )
    layer_convention: LayerConvention = Field(
        "vllm",
        description="How layer_ids are numbered: 'vllm' as above, or 'specforge' (0-based decoder "
        "layer outputs, as SpecForge/ModelOpt: j means vLLM id j+1, so their L-1 is the final state).",
    )
    store_dtype: StoreDtype = Field(
        "auto",
        description="Stored dtype of hidden states: 'auto' = the engine's dtype. bfloat16 is "
        "stored as uint16 with a logical_dtype attribute (zarr has no bfloat16). 'fp8_e4m3' "
        "stores each state vector as fp8 with one float32 scale per token and layer "
        "(hidden_scales): about half the bytes of bfloat16; readers return the engine's dtype.",
    )
    on_bad_states: Literal["fail", "skip", "off"] = Field(
        "fail",
        description="What a sample whose captured states fail a check does (non-finite values, "
        "an all-zero state vector or layer, a row count or token ids other than planned): "
        "'fail' fails its chunk naming the sample and the reason (retried, then failed for "
        "good); 'skip' commits the chunk and records the sample as skipped with its reason "
        "(readers leave it out); 'off' checks nothing.",
    )

    @field_validator("layer_ids")
    @classmethod
    def _distinct(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if not value:
                raise ValueError("layer_ids: expected at least one id, found an empty list")
            if len(set(value)) != len(value):
                raise ValueError(f"layer_ids: expected distinct ids, found {value}")
        return value


COLUMN_NAMES = ("messages", "id", "tools", "input_ids", "loss_mask")


class DataSettings(StrictSection):
    """The dataset and how it is tokenized."""

    SECTION: ClassVar[str] = "data"

    max_length: int | None = Field(
        None,
        ge=8,
        le=4_194_304,
        description="Samples are truncated to this many tokens; must be below "
        "engine.max_model_len (vLLM samples one token after each prompt). None = "
        "engine.max_model_len - 1.",
    )
    max_samples: int | None = Field(
        None, ge=1, description="Use only the first N conversations (None = all)."
    )
    format: Literal["auto", "jsonl", "json", "parquet", "arrow"] = Field(
        "auto",
        description="How the dataset is read. auto: from the path (.jsonl, .json: a JSON array "
        "or JSON lines, .parquet, a folder written by datasets' save_to_disk = arrow).",
    )
    split: str | None = Field(
        None, description="The split of a DatasetDict folder (save_to_disk of several splits)."
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="The dataset's names for hsx's columns, e.g. {'messages': 'dialog', 'id': "
        "'qid'}: messages (or conversations), id, tools, input_ids, loss_mask.",
    )
    on_overlength: Literal["truncate", "skip", "fail"] = Field(
        "truncate",
        description="A sample longer than max_length: truncate it (its first max_length tokens), "
        "skip it (left out of the store), or fail naming it. Truncated and skipped samples are "
        "counted in the run summary, logged, and listed in the store with their lengths.",
    )
    max_line_bytes: int = Field(
        8 * 2**20,
        ge=1024,
        le=2**30,
        description="Longest JSONL line accepted, in bytes: a longer one fails at once naming its "
        "line, and reading it costs at most this much memory (a 100 MB line once took the "
        "machine's whole memory in the tokenizer). 8 MiB holds a conversation of well over a "
        "million tokens.",
    )

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(COLUMN_NAMES))
        if unknown:
            raise ValueError(
                f"data.columns: expected keys among {list(COLUMN_NAMES)}, found {unknown}"
            )
        return value


class StoreSettings(StrictSection):
    """The Zarr store layout."""

    SECTION: ClassVar[str] = "layout"

    rows_per_chunk: int | None = Field(
        None,
        ge=16,
        le=1_048_576,
        description="Token rows per Zarr chunk (C). None = sized so one hidden-state object is "
        "about target_object_mib (per-object costs dominate small objects: measured here). Work "
        "chunks are padded to multiples of C, so no two writers touch one storage object.",
    )
    target_object_mib: float = Field(
        16.0, gt=0, le=1024, description="Aimed size of one hidden-state storage object (MiB)."
    )
    token_rows_per_object: int | None = Field(
        None,
        ge=16,
        description="Rows per storage object of input_ids and loss_mask (written once, at the "
        "store's creation; 5 bytes a row). None = about 65,536 rows (a multiple of C): C-row "
        "objects of a few KiB made 1.56M PUTs for 200M tokens. A multiple of rows_per_chunk.",
    )
    work_chunk_tokens: int | None = Field(
        None,
        ge=16,
        description="Tokens per work chunk (one Prefect task each). None = sized so a run holds "
        "about target_work_chunks tasks, at least min_work_chunk_tokens each.",
    )
    target_work_chunks: int = Field(
        256, ge=1, le=5000, description="Aim for this many work chunks when sizing automatically."
    )
    min_work_chunk_tokens: int = Field(
        4096, ge=16, description="Smallest automatic work chunk (tokens)."
    )
    direct_io: bool = Field(
        True,
        description="Write hidden-state objects on local disks with O_DIRECT, bypassing the page "
        "cache: they are written once and read much later, and buffered writes measured 4-35x "
        "the CPU time here. File systems without O_DIRECT (tmpfs) fall back to buffered writes.",
    )
    compressor: Literal["none", "zstd"] = Field(
        "none",
        description="Hidden-state compression. Measured here: zstd-1 is only 1.28x smaller on "
        "bf16 states and 4x slower than a raw write, so it is off by default.",
    )

    @model_validator(mode="after")
    def _work_chunks_hold_whole_storage_chunks(self) -> StoreSettings:
        # Each work chunk is padded to whole storage chunks: a smaller one writes a whole
        # object of padding (225 work chunks of 512 tokens in 16 MiB objects: 3.6 GB for 103k
        # tokens). With rows_per_chunk unset, planning sizes C to fit instead (and logs it).
        if (
            self.work_chunk_tokens is not None
            and self.rows_per_chunk is not None
            and self.work_chunk_tokens < self.rows_per_chunk
        ):
            raise ValueError(
                f"layout.work_chunk_tokens: expected at least layout.rows_per_chunk "
                f"({self.rows_per_chunk}: every work chunk is padded to whole storage chunks), "
                f"found {self.work_chunk_tokens}"
            )
        return self


class RunSettings(StrictSection):
    """Retries and reporting of the extraction flow."""

    SECTION: ClassVar[str] = "run"

    retries: int = Field(2, ge=0, le=20, description="Retries of a failed work chunk.")
    retry_delay_seconds: float = Field(
        2.0, ge=0, le=3600, description="First retry delay; doubles per retry, with jitter."
    )
    preflight: bool = Field(True, description="Run the preflight checks as the flow's first tasks.")
    repair: bool = Field(
        False,
        description="When verification finds corrupt chunks, drop their commit records and "
        "extract them again in the same run (then verify again).",
    )
    audit_positions: int = Field(
        2048,
        ge=0,
        le=10_000_000,
        description="Rows the end-of-run audit reads, spread over the chunks: their final "
        "states through the model's own final norm and LM head must predict the next tokens "
        "(states shifted against their tokens fail the run), and every captured layer is "
        "checked (hsx audit does the whole store). 0 turns it off.",
    )


class PipelineSettings(StrictSection):
    """How the host side keeps up with the engine: results queued, storage objects in flight.
    Nothing here changes the data."""

    SECTION: ClassVar[str] = "pipeline"

    prefetch_batches: int = Field(
        2,
        ge=0,
        le=16,
        description="Batches a chunk keeps queued at the engine beyond the one it waits for "
        "(0 left the engine idle 26% of the time on CPU).",
    )
    chunks_in_flight: int | None = Field(
        None,
        ge=1,
        le=32,  # hsx.extraction.host_pipeline.MAX_CHUNKS_IN_FLIGHT: the flow's task threads
        description="Work chunks a process extracts at once. None = enough that their batches "
        "fill the engine's queue (hsx.extraction.host_pipeline.chunks_in_flight), 3 to 32: on the H200, 3 chunks "
        "of 3.4k tokens each left the engine idle 20-40% of the time with the store on disk.",
    )
    io_threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Threads writing storage objects (writes release the GIL; an object "
        "store's latency overlaps). None = cpus/2 within 4..16 (4 measured on 2 cores; 8 on the "
        "16-core H200 machine took the disk store from 0.85 to 0.999 of plain).",
    )
    write_budget_mib: int | None = Field(
        None,
        ge=16,
        le=1_048_576,
        description="Host memory (MiB) of storage objects waiting to be written, for the whole "
        "process: what absorbs a disk's stalls before the engine has to wait. None = 1/32 of "
        "the machine's memory up to 4 GiB, at least 32 MiB per I/O thread (96 MiB measured "
        "enough on 2 cores; on the H200 256 MiB let the disk's stalls reach the engine).",
    )


class TimeoutSettings(StrictSection):
    """How long hsx waits on the things around it, and how many readers verify uses. Nothing
    here changes the data or the engine (no reload when one changes)."""

    SECTION: ClassVar[str] = "timeouts"

    server_handshake_s: float = Field(
        60.0,
        ge=1.0,
        le=3600.0,
        description="A new channel to an `hsx serve` server: seconds for the states of its test "
        "prompt to come back through this node's shared memory (a server on another node "
        "never answers; its compile on first use takes tens of seconds).",
    )
    server_result_s: float = Field(
        60.0,
        ge=1.0,
        le=3600.0,
        description="Seconds a server's answered request may wait for its states to arrive in "
        "shared memory before the batch fails (transient: the chunk retries).",
    )
    server_request_s: float = Field(
        1800.0,
        ge=10.0,
        le=86400.0,
        description="Seconds one batch request to a server may take in all (a long queue at a "
        "server shared by several runs is normal; a hung one fails the chunk).",
    )
    server_recheck_s: float = Field(
        2.0,
        ge=0.1,
        le=300.0,
        description="How often a server that was down is asked again by the pool.",
    )
    stop_wait_s: float = Field(
        5.0,
        ge=0.0,
        le=600.0,
        description="After a stop (Cancel, SIGTERM), seconds the flow waits for chunks in "
        "flight to reach a batch boundary or their commit before it records them abandoned.",
    )
    state_watch_s: float = Field(
        2.0,
        ge=0.5,
        le=300.0,
        description="How often a work item's child flow (hsx-extract-item) reads its own state "
        "in Prefect; once it is no longer Running (cancelled, declared Crashed) its chunks stop "
        "before their commit. One API request per running child per period: at 64 nodes, 2 s "
        "is 32 requests/s on the Prefect server (measured: the largest share of its requests).",
    )
    verify_readers: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Threads reading and hashing objects in verify. None = the CPU count, at "
        "least 8 (reads of a remote store overlap their latency).",
    )


class HsxSettings(BaseSettings):
    """Everything one extraction needs. The CLI and the flow take this same model."""

    model_config = SettingsConfigDict(
        env_prefix="HSX_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    model: Path = Field(..., description="Model folder: config.json, tokenizer, safetensors.")
    dataset: DatasetLocation = Field(
        ...,
        description="Conversations: a JSONL, JSON or Parquet file, a save_to_disk folder, a "
        "folder of such files, or a glob (data.format says how they are read); a local path or "
        "an fsspec URL (s3://bucket/train/*.parquet).",
    )
    store: str = Field(
        ..., description="Zarr store URL: a local path, file://, memory://, s3://, gs://, ..."
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
    capture: CaptureSettings = Field(default_factory=CaptureSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    layout: StoreSettings = Field(default_factory=StoreSettings)
    run: RunSettings = Field(default_factory=RunSettings)
    pipeline: PipelineSettings = Field(default_factory=PipelineSettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        # HSX_SERVER__*: `hsx serve`'s own section (settings.serve); HSX_GENERATION__* and
        # HSX_OUT: `hsx regenerate`'s (settings.regenerate). They may share the file.
        return refuse_unknown_keys(cls, data, frozenset({"server", "generation", "out"}))

    @model_validator(mode="after")
    def _samples_fit_the_engine(self) -> HsxSettings:
        # vLLM refuses a prompt that leaves no position for the token it samples after it, and
        # a refused request must not surface only after the model load.
        if (
            self.data.max_length is not None
            and self.engine.max_model_len is not None
            and self.data.max_length >= self.engine.max_model_len
        ):
            raise ValueError(
                f"data.max_length {self.data.max_length} must be below engine.max_model_len "
                f"{self.engine.max_model_len} (vLLM needs one position for the token it samples "
                f"after each prompt): set data.max_length to at most "
                f"{self.engine.max_model_len - 1} or engine.max_model_len to at least "
                f"{self.data.max_length + 1}"
            )
        return self


class SettingsWithoutEnvironment(HsxSettings):
    """HsxSettings from the given values alone, for runs hsx makes itself (the preflight
    probe's reduced model): a user's ``HSX_`` variables neither change nor fail them."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            message = unknown_keys_message("", data, list(cls.model_fields))
            if message is not None:
                raise ValueError(message)
        return data
