"""The files each trainer reads offline, built from one store sample (read from the trainers'
0.9.0 / 0.2.0 / 0.47.0 sources; tests load hsx's exports with the trainers' own readers).

Layer ids: hsx stores vLLM's numbering (id k = the residual stream entering decoder layer k, id L
= the final state before the last norm). speculators uses the same numbering; SpecForge and
ModelOpt number layer *outputs* (their j is vLLM's j + 1). Every export records both.

| trainer | files | final state |
|---|---|---|
| speculators | ``hidden_states/hs_{row}.safetensors`` (``hidden_states [seq, K, H]``, ``token_ids``) and a ``save_to_disk`` dataset (``input_ids``, ``loss_mask``, ``seq_len``) | pre-norm (its model applies the verifier's norm) |
| specforge | ``*.ckpt`` (torch.save: ``input_ids``, ``loss_mask``, ``aux_hidden_state [1, seq, (K-1)H]``, ``hidden_state [1, seq, H]``) | post-norm (its trainer applies lm_head directly) |
| modelopt | ``*.pt`` (``input_ids``, ``hidden_states [seq, H]``, ``aux_hidden_states [seq, (K-1)H]``, ``loss_mask``, ``conversation_id``, ``hidden_states_prenorm``) | pre-norm, flagged (its consumer re-applies the norm) |

Serialization goes through memory (``torch.save`` to a buffer): the bytes of a file depend only
on the sample, so a resumed export recognises a whole file by its checksum.
"""

from __future__ import annotations

import io
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hsx.errors import ConfigError
from hsx.store.reader import Sample
from hsx.trainers.final_norm import FinalNorm

FORMATS = ("speculators", "specforge", "modelopt")


@dataclass(frozen=True)
class ExportFile:
    """One file of an export: its path under the export's root and its bytes."""

    path: str
    payload: bytes


class _TorchSaveWithoutCrc:
    """torch.save's CRC32 of every record switched off while any export serializes.

    The CRC took 70% of a sample's serialization (4 of 5.5 ms for 13 MB on this project's
    CPU machine); torch.load never checks it, and every exported file's xxh3 is in the
    export's manifest. The switch (``torch.serialization.set_crc32_options``, torch >= 2.6) is
    process-wide, so concurrent writers share one count and the last one out restores it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writers = 0
        self._before = True
        self._options = (
            getattr(torch.serialization, "get_crc32_options", None),
            getattr(torch.serialization, "set_crc32_options", None),
        )

    def __enter__(self) -> None:
        get, put = self._options
        with self._lock:
            if self._writers == 0 and get is not None and put is not None:
                self._before = bool(get())
                put(False)
            self._writers += 1

    def __exit__(self, *exc: object) -> None:
        _, put = self._options
        with self._lock:
            self._writers -= 1
            if self._writers == 0 and put is not None:
                put(self._before)


_WITHOUT_CRC = _TorchSaveWithoutCrc()


def torch_bytes(value: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    with _WITHOUT_CRC:
        torch.save(value, buffer)  # to a buffer: the archive's name is fixed, the bytes repeatable
    return buffer.getvalue()


class TrainerFormat(ABC):
    """How one trainer's reader wants a sample on disk."""

    name: ClassVar[str]
    #: which final state the files hold: "pre-norm" (as stored) or "post-norm"
    final_state: ClassVar[str]

    def __init__(self, layer_ids: tuple[int, ...], num_layers: int) -> None:
        if len(layer_ids) < 2:
            raise ConfigError(
                f"export {self.name}: expected the store to hold aux layers and the final layer "
                f"(>= 2 layer ids), found {list(layer_ids)}"
            )
        if layer_ids[-1] != num_layers:
            raise ConfigError(
                f"export {self.name}: expected the store's last layer id to be {num_layers} (the "
                f"final state, vLLM numbering), found {layer_ids[-1]} in {list(layer_ids)}: "
                "extract with capture.layer_ids ending in the model's layer count"
            )
        self.layer_ids = layer_ids

    @property
    def needs_final_norm(self) -> bool:
        return self.final_state == "post-norm"

    def describe(self) -> dict[str, Any]:
        """What the manifest says of the layers and the final state."""
        aux = list(self.layer_ids[:-1])
        return {
            "format": self.name,
            "final_state": self.final_state,
            "layer_ids_vllm": list(self.layer_ids),
            "aux_layer_ids_vllm": aux,
            # SpecForge/ModelOpt/SGLang number layer outputs: their j is vLLM's j + 1.
            "aux_layer_ids_layer_outputs": [i - 1 for i in aux],
        }

    @abstractmethod
    def sample_files(
        self, sample: Sample, position: int, norm: FinalNorm | None
    ) -> list[ExportFile]:
        """The files of one sample; ``position`` is its row in the export (0, 1, ...)."""


class SpeculatorsFormat(TrainerFormat):
    name = "speculators"
    final_state = "pre-norm"

    def sample_files(
        self, sample: Sample, position: int, norm: FinalNorm | None
    ) -> list[ExportFile]:
        from safetensors.torch import save

        tensors = {
            "hidden_states": sample.hidden_states.contiguous(),  # [seq, K, H], final last
            "token_ids": sample.input_ids.to(torch.int64).contiguous(),  # must equal input_ids
        }
        return [ExportFile(f"hidden_states/hs_{position}.safetensors", save(tensors))]


def _post_norm(sample: Sample, norm: FinalNorm | None, dtype: torch.dtype) -> torch.Tensor:
    if norm is None:
        raise ConfigError("a post-norm export needs the model's final norm (--model MODEL_DIR)")
    return norm(sample.target_hidden_states).to(dtype)  # [seq, H]


class SpecForgeFormat(TrainerFormat):
    name = "specforge"
    final_state = "post-norm"

    def sample_files(
        self, sample: Sample, position: int, norm: FinalNorm | None
    ) -> list[ExportFile]:
        dtype = sample.hidden_states.dtype
        record = {
            "input_ids": sample.input_ids.to(torch.int64).contiguous(),  # [seq]
            "loss_mask": sample.loss_mask.to(torch.int64).contiguous(),  # [seq]
            "hidden_state": _post_norm(sample, norm, dtype)[None].contiguous(),  # [1, seq, H]
            "aux_hidden_state": sample.aux_hidden_states[None].contiguous(),  # [1, seq, (K-1)H]
        }
        # Zero-padded names: SpecForge sorts paths as strings (data_10 before data_2).
        return [ExportFile(f"data/data_{position:09d}.ckpt", torch_bytes(record))]


class ModelOptFormat(TrainerFormat):
    name = "modelopt"
    final_state = "pre-norm"

    def sample_files(
        self, sample: Sample, position: int, norm: FinalNorm | None
    ) -> list[ExportFile]:
        record = {
            "input_ids": sample.input_ids.to(torch.int64).contiguous(),  # [seq]
            "hidden_states": sample.target_hidden_states.contiguous(),  # [seq, H] pre-norm
            "aux_hidden_states": sample.aux_hidden_states.contiguous(),  # [seq, (K-1)H]
            "loss_mask": sample.loss_mask.to(torch.int64).contiguous(),  # [seq]
            "conversation_id": int(sample.index),  # the store's sample index
            # Its consumer re-applies the base model's final norm to pre-norm states.
            "hidden_states_prenorm": True,
        }
        return [ExportFile(f"data/{position:09d}.pt", torch_bytes(record))]


def trainer_format(name: str, layer_ids: tuple[int, ...], num_layers: int) -> TrainerFormat:
    kinds: dict[str, type[TrainerFormat]] = {
        "speculators": SpeculatorsFormat,
        "specforge": SpecForgeFormat,
        "modelopt": ModelOptFormat,
    }
    if name not in kinds:
        raise ConfigError(f"export format: expected one of {list(kinds)}, found {name!r}")
    return kinds[name](layer_ids, num_layers)
