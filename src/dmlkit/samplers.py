"""Batch samplers for metric learning: class-balanced batches and few-shot episodes.

Both are *batch samplers*: iterate to get lists of dataset indices, and pass them to
``DataLoader(dataset, batch_sampler=sampler)``. Both are deterministic given ``seed`` and the
epoch: call ``sampler.set_epoch(epoch)`` before each epoch (as with ``DistributedSampler``);
without it, each new iteration moves to the next epoch by itself. ``state_dict()`` /
``load_state_dict()`` save and restore that position for resumable training.

* :class:`MPerClassSampler` - each batch holds ``C`` classes x ``M`` samples (the Reality
  Check's ``C = 8, M = 4`` for embedding losses and ``C = 32, M = 1`` for classification
  losses; the "balanced batch sampler" of seed 003).
* :class:`EpisodeSampler` - ``N``-way ``K``-shot episodes with ``Q`` queries per class
  (Snell et al., "Prototypical Networks for Few-shot Learning", NeurIPS 2017), and
  :func:`split_episode` to cut an episode batch into its support and query parts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from dmlkit.exceptions import CheckpointError, ConfigError, DataError
from dmlkit.limits import MAX_BATCHES_PER_EPOCH, MAX_EPISODES
from dmlkit.validation import check_integer, check_labels, check_seed

__all__ = ["EpisodeSampler", "MPerClassSampler", "split_episode"]


def _as_label_array(labels: Any) -> np.ndarray:
    """``labels`` (a tensor, array, list or tuple) as a 1-D numpy array, checked by
    :func:`dmlkit.validation.check_labels` (:class:`~dmlkit.exceptions.DataError` if empty)."""
    tensor = hasattr(labels, "detach")
    arr = labels.detach().cpu() if tensor else np.asarray(labels)
    if arr.ndim != 1:
        raise DataError(f"labels must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.shape[0] == 0:
        raise DataError("labels are empty: the dataset has no items")
    if tensor:  # numbers only, read by check_labels as int64 ids whatever the dtype (bfloat16,
        # which has no numpy twin, raised TypeError in .numpy())
        return check_labels(arr, arr.shape[0], "sampler labels")[0]
    # integer ids or class names; None, NaN, fractions or a mix gave numpy's TypeError (or were
    # grouped as classes). A list or tuple is checked as given: np.asarray turned [1, "1"] into
    # strings, one class, which check_labels refuses in the list itself
    check_labels(labels if isinstance(labels, list | tuple) else arr, arr.shape[0], "sampler labels")
    return arr


def _class_members(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    classes, inverse = np.unique(labels, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=len(classes)))[:-1]
    return classes, np.split(order, bounds)


class _EpochSampler(Sampler[list[int]]):
    """Shared seed/epoch handling and the rank's share of each global batch."""

    def __init__(self, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        self.seed = check_seed(seed)  # else numpy's ValueError at the first batch
        self.epoch = 0
        self.num_replicas = check_integer(num_replicas, "num_replicas")
        self.rank = check_integer(rank, "rank", least=0, most=self.num_replicas - 1,
                                  hint=f" (this process among num_replicas={self.num_replicas})")

    @property
    def batch_size(self) -> int:  # the global batch
        raise NotImplementedError

    @property
    def local_batch_size(self) -> int:
        """Items this rank yields per batch: ``batch_size / num_replicas``."""
        return self.batch_size // self.num_replicas

    def _check_divisible(self, structure: str) -> None:
        if self.batch_size % self.num_replicas:
            raise ConfigError(
                f"the global batch of {structure} = {self.batch_size} items cannot be split evenly "
                f"over {self.num_replicas} processes: make it a multiple of {self.num_replicas} "
                "(or start another number of processes)"
            )

    def _share(self, batch: list[int]) -> list[int]:
        """This rank's contiguous share of a global batch."""
        if self.num_replicas == 1:
            return batch
        n = self.local_batch_size
        return batch[self.rank * n : (self.rank + 1) * n]

    def set_epoch(self, epoch: int) -> None:
        """Fix the epoch of the next iteration (the batches are a function of seed and epoch)."""
        self.epoch = check_integer(epoch, "epoch", least=0)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a :meth:`state_dict`: its ``seed`` and ``epoch``, checked as the
        constructor and :meth:`set_epoch` check them, else one
        :class:`~dmlkit.exceptions.CheckpointError` line (``{}`` raised KeyError, a seed of -5
        numpy's ValueError at the first batch; a seed of ``2**40`` and an epoch of 1.7 were
        taken, the epoch truncated)."""
        if not isinstance(state, Mapping) or set(state) != {"seed", "epoch"}:
            got = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(f"a sampler state holds exactly 'seed' and 'epoch' (from "
                                  f"state_dict()), got {got}")
        try:
            seed = check_seed(state["seed"], "sampler state seed")
            epoch = check_integer(state["epoch"], "sampler state epoch", least=0)
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from None
        self.seed, self.epoch = seed, epoch

    def _next_rng(self) -> np.random.Generator:
        rng = np.random.default_rng([self.seed, self.epoch])
        self.epoch += 1
        return rng


class MPerClassSampler(_EpochSampler):
    """Batches of ``classes_per_batch`` (C) classes x ``samples_per_class`` (M) items.

    Each batch lists its C classes one after the other (class-major: items
    ``[c * M, (c + 1) * M)`` share a label) and no class appears twice in a batch. Classes are
    taken from a shuffled cycle over all usable classes, so within an epoch every class is
    used about equally often; a class's items are taken from a shuffled cycle over that class,
    without repetition inside a batch. When fewer than M items are left in a class's cycle,
    they are taken first and the batch is filled from the next cycle, which leaves out the
    items just taken and puts them at its end: every item is drawn once per cycle, also when
    the class size is not a multiple of M. The cycles restart at each epoch.

    Args:
        labels: one label per dataset item (array-like or tensor of hashable ids).
        samples_per_class: M.
        classes_per_batch: C (batch size = C x M).
        batches_per_epoch: fixed epoch length; default ``len(labels) // (C * M)`` (at least 1);
            at most :data:`~dmlkit.limits.MAX_BATCHES_PER_EPOCH`.
        seed: base seed; batches depend only on ``(seed, epoch)``.
        small_classes: what to do with classes that have fewer than M items: ``"replace"``
            (default; use all their items and fill up by sampling them again, so the batch
            contains duplicates), ``"drop"`` (never sample those classes) or ``"error"``
            (raise :class:`~dmlkit.exceptions.DataError`).
        num_replicas, rank: distributed training: yield this rank's share of each global
            C x M batch (see the module docstring); C x M must be divisible by num_replicas.

    Raises :class:`~dmlkit.exceptions.DataError` when fewer than C (usable) classes exist.
    """

    def __init__(
        self,
        labels: Sequence[Any] | np.ndarray,
        samples_per_class: int,
        classes_per_batch: int,
        batches_per_epoch: int | None = None,
        seed: int = 0,
        small_classes: str = "replace",
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(seed, num_replicas, rank)
        self.samples_per_class = check_integer(samples_per_class, "samples_per_class")
        self.classes_per_batch = check_integer(classes_per_batch, "classes_per_batch")
        if small_classes not in ("replace", "drop", "error"):
            raise ConfigError(
                f"small_classes must be 'replace', 'drop' or 'error', got {small_classes!r}"
            )
        self.small_classes = small_classes
        arr = _as_label_array(labels)
        classes, members = _class_members(arr)
        m = self.samples_per_class
        small = [c for c, idx in zip(classes, members) if len(idx) < m]
        if small and small_classes == "error":
            raise DataError(
                f"{len(small)} classes have fewer than samples_per_class={m} items (e.g. class "
                f"{small[0]!r}); lower samples_per_class, or set small_classes='replace' or 'drop'"
            )
        if small_classes == "drop":
            keep = [i for i, idx in enumerate(members) if len(idx) >= m]
            classes = classes[keep]
            members = [members[i] for i in keep]
        if len(classes) < self.classes_per_batch:
            extra = f" with at least {m} items" if small_classes == "drop" else ""
            raise DataError(
                f"only {len(classes)} classes{extra} but classes_per_batch="
                f"{self.classes_per_batch}: lower classes_per_batch or use more classes"
            )
        self.classes = classes
        self._members = members
        if batches_per_epoch is None:
            batches_per_epoch = max(1, len(arr) // self.batch_size)
        self.batches_per_epoch = check_integer(batches_per_epoch, "batches_per_epoch",
                                               most=MAX_BATCHES_PER_EPOCH)
        self._check_divisible(f"classes_per_batch x samples_per_class = "
                              f"{self.classes_per_batch} x {self.samples_per_class}")

    @property
    def batch_size(self) -> int:
        return self.classes_per_batch * self.samples_per_class

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        rng = self._next_rng()
        num_classes, c, m = len(self._members), self.classes_per_batch, self.samples_per_class
        class_queue: list[int] = []
        item_perm = [rng.permutation(idx) for idx in self._members]
        item_pos = [0] * num_classes
        for _ in range(self.batches_per_epoch):
            chosen = class_queue[:c]
            class_queue = class_queue[c:]
            if len(chosen) < c:
                # next cycle over the classes; the r classes already taken from the old cycle
                # move to the end of the new one, so no class repeats inside a batch and every
                # class still appears once per cycle
                taken = set(chosen)
                fresh = [int(k) for k in rng.permutation(num_classes) if int(k) not in taken]
                need = c - len(chosen)
                class_queue = fresh[need:] + chosen
                chosen = chosen + fresh[:need]
            batch: list[int] = []
            for k in chosen:
                batch.extend(self._take(k, m, item_perm, item_pos, rng))
            yield self._share(batch)

    def _take(self, k: int, m: int, perm: list[np.ndarray], pos: list[int], rng) -> list[int]:
        """The next ``m`` distinct items of class ``k``'s cycle (``perm[k]`` from ``pos[k]``)."""
        idx = self._members[k]
        if len(idx) < m:  # small class, small_classes == "replace"
            extra = rng.choice(idx, size=m - len(idx), replace=True)
            return [int(i) for i in rng.permutation(idx)] + [int(i) for i in extra]
        if pos[k] + m > len(perm[k]):
            # the r < m items left in this cycle come first; the next cycle, without them, fills
            # the batch and takes them at its end (as the class queue in __iter__ does)
            tail = [int(i) for i in perm[k][pos[k]:]]
            taken = set(tail)
            fresh = [int(i) for i in rng.permutation(idx) if int(i) not in taken]
            need = m - len(tail)
            perm[k] = np.asarray(fresh[need:] + tail, dtype=np.int64)
            pos[k] = 0
            return tail + fresh[:need]
        out = perm[k][pos[k] : pos[k] + m]
        pos[k] += m
        return [int(i) for i in out]

    def __repr__(self) -> str:
        return (
            f"MPerClassSampler(C={self.classes_per_batch}, M={self.samples_per_class}, "
            f"batches_per_epoch={self.batches_per_epoch}, classes={len(self.classes)}, "
            f"seed={self.seed}, small_classes={self.small_classes!r}"
            + (f", rank={self.rank}/{self.num_replicas})" if self.num_replicas > 1 else ")")
        )


class EpisodeSampler(_EpochSampler):
    """Few-shot episodes: ``n_way`` classes, ``k_shot`` support + ``n_query`` query items each.

    Layout of each yielded index list (length ``n_way * (k_shot + n_query)``), class-major with
    support before query inside each class::

        [c0 s0 .. c0 s(K-1), c0 q0 .. c0 q(Q-1),  c1 s0 .. c1 s(K-1), c1 q0 .., ...]

    so a batch reshaped to ``(n_way, k_shot + n_query, ...)`` has the support in ``[:, :K]``
    and the queries in ``[:, K:]``; :func:`split_episode` (or :meth:`split`) does that cut.
    Classes are drawn uniformly without replacement among those with at least
    ``k_shot + n_query`` items; items within a class are distinct. ``episodes`` (per epoch) is
    at most :data:`~dmlkit.limits.MAX_EPISODES` (``10**23`` iterated for ever).

    Raises :class:`~dmlkit.exceptions.DataError` when fewer than ``n_way`` classes have enough
    items. ``num_replicas``/``rank``: distributed training, this rank's contiguous share of each
    episode (the episode's size must be divisible by ``num_replicas``).
    """

    def __init__(
        self,
        labels: Sequence[Any] | np.ndarray,
        n_way: int,
        k_shot: int,
        n_query: int,
        episodes: int,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(seed, num_replicas, rank)
        self.n_way = check_integer(n_way, "n_way")
        self.k_shot = check_integer(k_shot, "k_shot")
        self.n_query = check_integer(n_query, "n_query", least=0)
        self.episodes = check_integer(episodes, "episodes", most=MAX_EPISODES)
        arr = _as_label_array(labels)
        classes, members = _class_members(arr)
        need = self.k_shot + self.n_query
        keep = [i for i, idx in enumerate(members) if len(idx) >= need]
        if len(keep) < self.n_way:
            raise DataError(
                f"only {len(keep)} classes have at least k_shot + n_query = {need} items but "
                f"n_way={self.n_way}: lower n_way, k_shot or n_query"
            )
        self.classes = classes[keep]
        self._members = [members[i] for i in keep]
        self._check_divisible(f"n_way x (k_shot + n_query) = {self.n_way} x {need}")

    @property
    def batch_size(self) -> int:
        return self.n_way * (self.k_shot + self.n_query)

    def __len__(self) -> int:
        return self.episodes

    def __iter__(self) -> Iterator[list[int]]:
        rng = self._next_rng()
        per_class = self.k_shot + self.n_query
        for _ in range(self.episodes):
            chosen = rng.choice(len(self._members), size=self.n_way, replace=False)
            batch: list[int] = []
            for k in chosen:
                picks = rng.choice(self._members[k], size=per_class, replace=False)
                batch.extend(int(i) for i in picks)
            yield self._share(batch)

    def split(self, batch):
        """``(support, query)`` of an episode batch; see :func:`split_episode`."""
        return split_episode(batch, self.n_way, self.k_shot, self.n_query)

    def __repr__(self) -> str:
        return (
            f"EpisodeSampler(n_way={self.n_way}, k_shot={self.k_shot}, n_query={self.n_query}, "
            f"episodes={self.episodes}, classes={len(self.classes)}, seed={self.seed})"
        )


def split_episode(batch, n_way: int, k_shot: int, n_query: int):
    """Cut an episode batch (tensor or array, first dim ``n_way * (k_shot + n_query)``, in
    :class:`EpisodeSampler`'s layout) into ``support`` ``(n_way * k_shot, ...)`` and ``query``
    ``(n_way * n_query, ...)``, both class-major (support ``i`` belongs to way ``i // k_shot``,
    query ``j`` to way ``j // n_query``). Works for images, embeddings and labels alike."""
    per_class = k_shot + n_query
    if isinstance(batch, list):
        batch = np.asarray(batch)
    if batch.shape[0] != n_way * per_class:
        raise DataError(
            f"episode batch has {batch.shape[0]} items, expected n_way * (k_shot + n_query) = "
            f"{n_way * per_class}"
        )
    grouped = batch.reshape(n_way, per_class, *batch.shape[1:])
    support = grouped[:, :k_shot].reshape(n_way * k_shot, *batch.shape[1:])
    query = grouped[:, k_shot:].reshape(n_way * n_query, *batch.shape[1:])
    return support, query
