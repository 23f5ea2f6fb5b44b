"""Augmentations that depend on an item's place in the global batch, not on the process that
loads it: :class:`SeededBatches` pairs each sampled index with :func:`item_seed`, and
:class:`SeededItems` loads it under that seed (used by :class:`dmlkit.training.loop.Trainer`)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from dmlkit.signals import ignore_stop_signals

__all__ = ["SeededBatches", "SeededItems", "item_seed", "seed_worker"]

_MASK64 = (1 << 64) - 1


def item_seed(seed: int, epoch: int, batch: int, position: int) -> int:
    """The augmentation seed of the item at ``position`` of global batch ``batch`` of ``epoch``.

    A SplitMix64 finaliser (Steele, Lea & Flood, OOPSLA 2014) over the four numbers, so nearby
    inputs get unrelated seeds. It depends on where the item sits in the *global* batch, not on
    which process loads it or on any RNG state: a run draws the same augmentations with 1 or W
    processes, with or without loader workers, and after a resume."""
    z = 0
    for value in (seed, epoch, batch, position):
        z = (z + (int(value) & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z & ((1 << 63) - 1)


class SeededBatches:
    """A batch sampler yielding each batch of ``sampler`` as ``(dataset index, item seed)``
    pairs (:func:`item_seed`); this rank's items sit at ``rank x local batch + j`` of the
    global batch."""

    def __init__(self, sampler: Any, seed: int, epoch: int) -> None:
        self.sampler, self.seed, self.epoch = sampler, int(seed), int(epoch)
        self.offset = int(getattr(sampler, "rank", 0)) * int(getattr(sampler, "local_batch_size", 0))

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for b, batch in enumerate(self.sampler):
            yield [(i, item_seed(self.seed, self.epoch, b, self.offset + j)) for j, i in enumerate(batch)]


class SeededItems(torch.utils.data.Dataset):
    """``dataset[index]`` loaded under ``torch.manual_seed(item seed)`` (the process's own RNG
    stream is left untouched), for keys ``(index, item seed)`` from :class:`SeededBatches`:
    random augmentations are a function of the item's place in the global batch."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        with torch.random.fork_rng(devices=[]):
            # the CPU generator alone: loading draws on it only, and torch.manual_seed would also
            # seed every accelerator (78 us against 1 us per item, measured on the 2-core EPYC)
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]


def seed_worker(worker_id: int) -> None:
    """A training DataLoader worker's ``worker_init_fn``: numpy and ``random`` streams from its
    torch seed, and Ctrl-C, SIGTERM and SIGHUP ignored (:func:`dmlkit.signals.ignore_stop_signals`:
    the main process stops its workers)."""
    ignore_stop_signals(worker_id)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
