"""Training straight from a store, no export: for each trainer a ``torch.utils.data.Dataset``
that yields exactly the item that trainer's own loader yields from its files (so its collate
function and training step take it as it is), and a sampler that groups samples of similar
length and shards them by rank.

Safe in DataLoader workers, fork or spawn: a dataset pickles as its URL and sample list; each
process opens the store on its first item (a zarr group or an fsspec session is not shared
across processes).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from hsx.store.reader import HiddenStatesReader, Sample
from hsx.trainers.final_norm import FinalNorm

IGNORE_TOKEN_ID = -100  # ModelOpt's label of positions without a next token


class StoreDataset(Dataset[dict[str, torch.Tensor]]):
    """The committed samples of a store (or ``samples`` of them), one item each."""

    def __init__(self, store_url: str, samples: Sequence[int] | None = None) -> None:
        self.store_url = store_url
        reader = HiddenStatesReader(store_url)
        chosen = reader.available_samples if samples is None else np.asarray(samples)
        self.samples = np.asarray(chosen, dtype=np.int64)
        _, lengths = reader.store.sample_rows(0, reader.num_samples)
        self.lengths = lengths[self.samples].astype(np.int64)  # [n] tokens per item
        self.hidden_size = reader.hidden_size
        self.layer_ids = reader.layer_ids
        self._reader: HiddenStatesReader | None = reader
        self._pid = os.getpid()

    def reader(self) -> HiddenStatesReader:
        """This process's reader (a worker opens its own)."""
        if self._reader is None or self._pid != os.getpid():
            self._reader = HiddenStatesReader(self.store_url)
            self._pid = os.getpid()
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"] = None  # reopened in the worker
        return state

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        return self.item(self.reader().sample(int(self.samples[position])))

    def __getitems__(self, positions: list[int]) -> list[dict[str, torch.Tensor]]:
        """A DataLoader batch: every storage object its samples touch read once."""
        chosen = [int(self.samples[p]) for p in positions]
        return [self.item(sample) for sample in self.reader().samples(chosen)]

    def item(self, sample: Sample) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class SpeculatorsDataset(StoreDataset):
    """speculators' ``ArrowDataset`` item: ``hidden_states [seq, (K-1)H]`` (aux layers),
    ``input_ids``, ``verifier_last_hidden_states [seq, H]`` (pre-norm: its model applies the
    verifier's norm), ``loss_mask`` (int64), ``lengths [1]``, ``position_ids``."""

    def item(self, sample: Sample) -> dict[str, torch.Tensor]:
        seq = int(sample.input_ids.shape[0])
        return {
            "hidden_states": sample.aux_hidden_states,
            "input_ids": sample.input_ids,
            "verifier_last_hidden_states": sample.target_hidden_states,
            "loss_mask": sample.loss_mask.to(torch.int64),
            "lengths": torch.tensor([seq], dtype=torch.long),
            "position_ids": torch.arange(seq, dtype=torch.long),
        }


class SpecForgeDataset(StoreDataset):
    """SpecForge's normalized offline sample (``normalize_offline_sample``): ``input_ids``,
    ``loss_mask`` (last position cleared), ``attention_mask``, ``hidden_state [1, s, (K-1)H]``
    (aux) and ``target [1, s, H]`` after the model's final norm, cut to ``max_len``."""

    def __init__(
        self,
        store_url: str,
        norm: FinalNorm,
        max_len: int = 2048,
        samples: Sequence[int] | None = None,
    ) -> None:
        super().__init__(store_url, samples)
        self.norm = norm
        self.max_len = max_len

    def item(self, sample: Sample) -> dict[str, torch.Tensor]:
        n = self.max_len
        dtype = sample.hidden_states.dtype
        loss_mask = sample.loss_mask[:n].to(torch.int64).clone()[None]
        if loss_mask.numel() > 0:
            loss_mask[0, -1] = 0
        return {
            "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
            "loss_mask": loss_mask,
            "target": self.norm(sample.target_hidden_states[:n]).to(dtype)[None],
            "hidden_state": sample.aux_hidden_states[:n][None],
            "input_ids": sample.input_ids[:n][None],
        }


class ModelOptDataset(StoreDataset):
    """ModelOpt's ``OfflineSupervisedDataset`` item (answer-only loss): ``input_ids``,
    ``base_model_hidden_states`` (pre-norm, flagged: its consumer re-applies the norm),
    ``aux_hidden_states``, ``attention_mask``, ``loss_mask``, ``labels``,
    ``base_hidden_prenorm``."""

    def item(self, sample: Sample) -> dict[str, Any]:
        ids = sample.input_ids
        labels = torch.full_like(ids, IGNORE_TOKEN_ID)
        labels[..., :-1] = ids[..., 1:]
        return {
            "input_ids": ids,
            "base_model_hidden_states": sample.target_hidden_states,
            "aux_hidden_states": sample.aux_hidden_states,
            "attention_mask": torch.ones_like(ids),
            "loss_mask": sample.loss_mask.to(ids.dtype),
            "labels": labels,
            "base_hidden_prenorm": True,
        }


class LengthGroupedSampler(Sampler[int]):
    """Positions of a StoreDataset for one rank: shuffled by ``seed`` and epoch, then grouped
    in windows of ``group`` positions sorted by length (batches of similar lengths pad
    little), each rank taking every ``world_size``-th position; every rank gets the same count
    (the list is padded by wrapping around)."""

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        rank: int = 0,
        world_size: int = 1,
        group: int = 256,
        seed: int = 0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0..{world_size - 1}, found {rank}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.rank, self.world_size = rank, world_size
        self.group, self.seed, self.epoch = max(1, group), seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.world_size)

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng(self.seed + self.epoch)
        order = rng.permutation(len(self.lengths))
        windows = [order[i : i + self.group] for i in range(0, len(order), self.group)]
        grouped = (
            np.concatenate([w[np.argsort(self.lengths[w], kind="stable")] for w in windows])
            if windows
            else order
        )
        total = len(self) * self.world_size
        if total > len(grouped):
            grouped = np.concatenate([grouped, grouped[: total - len(grouped)]])
        return iter(int(i) for i in grouped[self.rank : total : self.world_size])
