"""What a store froze: every input that changes the stored data, checked in seconds on resume.

A resumed run must write exactly what the first run would have. Planning refuses another plan
(hsx.store.zarr_store), but only after tokenizing the whole dataset, and the flow ran the preflight probe
(a model build) before planning. This check reads the store's attributes, the model folder's
identity (config, weight files, revision), the tokenizer and chat template, and a fingerprint of
the dataset, and names each changed input with both values, before any model is loaded.

Settings that do not change the data (retries, batch sizes, concurrency, tensor parallelism,
engine memory) are not frozen: a resume may change them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import xxhash

from hsx.data.tokenization import fingerprint_dataset
from hsx.errors import StoreError
from hsx.plan.building import config_hash, state_encoding
from settings import HsxSettings

logger = logging.getLogger(__name__)

# Weight files hashed whole up to this size; larger ones by their size, safetensors header and
# samples of their first and last data bytes (a terabyte of shards cannot be read in seconds,
# and re-seeded or re-trained weights change those bytes too).
_WHOLE_FILE_BYTES = 64 * 2**20
_SAMPLE_BYTES = 1 * 2**20
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_MAX_SAFETENSORS_HEADER = 100 * 2**20

# The frozen inputs, in the order a refusal names them, with what each means to a user.
FROZEN_INPUTS: dict[str, str] = {
    "model_config_hash": "the model's config.json",
    "weights_fingerprint": "the model's weight files",
    "model_revision": "the model's revision",
    "layer_ids": "captured layer ids (vLLM convention)",
    "max_length": "data.max_length",
    "max_samples": "data.max_samples",
    "dataset_fingerprint": "the dataset's content (every file of it)",
    "dataset_reading": "data.format, data.split, data.columns and data.on_overlength",
    "vocabulary_fingerprint": "the tokenizer",
    "chat_template_fingerprint": "the chat template",
    "engine_dtype": "engine.dtype",
    "logical_dtype": "capture.store_dtype",
    "state_encoding": "capture.store_dtype",
}


def _hash_file(digest: Any, path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as source:
        if size <= _WHOLE_FILE_BYTES:
            while block := source.read(8 * 2**20):
                digest.update(block)
            return
        start = 0
        if path.suffix == ".safetensors":
            header_len = int.from_bytes(source.read(8), "little")
            start = 8 + min(header_len, _MAX_SAFETENSORS_HEADER)
            source.seek(0)
            digest.update(source.read(start))  # every tensor's name, dtype, shape and offsets
        source.seek(start)
        digest.update(source.read(_SAMPLE_BYTES))
        source.seek(max(size - _SAMPLE_BYTES, start))
        digest.update(source.read(_SAMPLE_BYTES))


def weights_fingerprint(model_dir: Path, load_format: str, seed: int) -> str:
    """Identity of the weights the engine will load: their files (names, sizes, headers, data
    samples), or the seed of vLLM's dummy weights. A moved model folder keeps its identity."""
    if load_format == "dummy":
        return f"dummy weights, seed {seed}"
    files = sorted({p for pattern in _WEIGHT_PATTERNS for p in model_dir.glob(pattern)})
    if not files:
        return "no weight files"
    digest = xxhash.xxh3_128()
    for path in files:
        _hash_file(digest, path)
    return f"{len(files)} files, xxh3 {digest.hexdigest()}"


def model_revision(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The Hub revision where it is known: a Hugging Face cache snapshot folder is named by its
    commit; transformers also records ``_commit_hash`` in configs it saved."""
    resolved = model_dir.resolve()
    if resolved.parent.name == "snapshots":
        return resolved.name
    commit = config.get("_commit_hash")
    return str(commit) if commit else None


def vocabulary_fingerprint(tokenizer: Any) -> str:
    backend = tokenizer.backend_tokenizer
    return str(xxhash.xxh3_128_hexdigest(backend.to_str().encode("utf-8")))


def chat_template_fingerprint(tokenizer: Any) -> str:
    template = tokenizer.chat_template
    if not isinstance(template, str):  # None, or a dict of named templates
        template = json.dumps(template, sort_keys=True)
    return str(xxhash.xxh3_128_hexdigest(template.encode("utf-8")))


def frozen_inputs(
    settings: HsxSettings,
    config: dict[str, Any],
    tokenizer: Any,
    layer_ids: tuple[int, ...],
    engine_dtype: str,
    stored_dtype: str,
) -> dict[str, Any]:
    """This run's values of every frozen input (settings with model defaults resolved)."""
    return {
        "model_config_hash": config_hash(config),
        "weights_fingerprint": weights_fingerprint(
            settings.model, settings.engine.load_format, settings.engine.seed
        ),
        "model_revision": model_revision(settings.model, config),
        "layer_ids": list(layer_ids),
        "max_length": settings.data.max_length,
        "max_samples": settings.data.max_samples,
        "dataset_fingerprint": fingerprint_dataset(
            settings.dataset, settings.data.format, settings.data.split
        ),
        "dataset_reading": dataset_reading(settings),
        "vocabulary_fingerprint": vocabulary_fingerprint(tokenizer),
        "chat_template_fingerprint": chat_template_fingerprint(tokenizer),
        "engine_dtype": engine_dtype,
        "logical_dtype": stored_dtype,
        "state_encoding": state_encoding(settings),
    }


def dataset_reading(settings: HsxSettings) -> dict[str, Any]:
    """How the dataset's rows become samples: another reading of the same bytes is other data."""
    data = settings.data
    return {
        "format": data.format,
        "split": data.split,
        "columns": dict(sorted(data.columns.items())),
        "on_overlength": data.on_overlength,
    }


def frozen_differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per changed frozen input, naming it and both values. Inputs an older store did
    not record are not compared (planning still compares its plan hash)."""
    return [
        f"{key} ({FROZEN_INPUTS[key]}): stored {stored[key]!r}, this run {current.get(key)!r}"
        for key in FROZEN_INPUTS
        if key in stored and stored[key] != current.get(key)
    ]


def stored_frozen_inputs(meta: dict[str, Any]) -> dict[str, Any]:
    """What a store froze: its ``frozen_inputs``, else (a store of an earlier hsx) the inputs
    its plan recorded that mean the same."""
    frozen = meta.get("frozen_inputs")
    if isinstance(frozen, dict):
        return dict(frozen)
    plan = meta.get("plan_inputs", {})
    same = (
        *("model_config_hash", "layer_ids", "max_length", "max_samples"),
        *("dataset_fingerprint", "logical_dtype"),
    )
    return {key: plan[key] for key in same if key in plan}


def check_frozen(url: str, meta: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise StoreError naming every frozen input this run changed against store ``url``."""
    changed = frozen_differences(stored_frozen_inputs(meta), current)
    if changed:
        raise StoreError(
            f"store {url} was written with other inputs; a resume must write the same data. "
            "Changed: " + "; ".join(changed) + ". Use a new store URL, or delete this one "
            "to start over."
        )
