"""Training and scoring of patch networks: hinge loss (decision nets), hinge embedding loss
(``-l2`` descriptors) and dmlkit's triplet loss with batch-hard mining (``hardnet``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field, ValidationError
from torch import nn

from dmlkit.apps.patches.brown import PatchPairs
from dmlkit.apps.patches.models import HardNetDescriptor, PatchNet, SiameseNet
from dmlkit.config import StrictNumbers, format_validation_error
from dmlkit.exceptions import ConfigError, DataError, NonFiniteError, ShapeError
from dmlkit.losses import get_loss
from dmlkit.miners import get_miner
from dmlkit.samplers import MPerClassSampler

__all__ = ["PatchTrainingSettings", "TrainSettings", "hinge_embedding_loss", "hinge_loss", "score_pairs", "train_patch_model"]


def hinge_loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Zagoruyko & Komodakis (CVPR 2015), Eq. 1 without the weight term: ``mean_i max(0, 1 - y_i o_i)``,
    ``y_i`` in ``{+1, -1}``, ``o_i`` in ``[-1, 1]``. (The ``lambda ||w||^2`` term is the optimiser's
    weight decay; the mean instead of the sum only rescales the learning rate.)"""
    return torch.clamp(1.0 - y * o, min=0.0).mean()


def hinge_embedding_loss(d: torch.Tensor, y: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """Hinge embedding loss on descriptor distances (the paper's ``-l2`` nets; Torch's
    ``HingeEmbeddingCriterion``): ``d`` for matches, ``max(0, margin - d)`` for non-matches, averaged."""
    return torch.where(y > 0, d, torch.clamp(margin - d, min=0.0)).mean()


class PatchTrainingSettings(StrictNumbers):
    """Budget and optimiser of a patch network's training, checked on construction: the one
    home of these values and their limits (``training`` of ``configs/patches*.yaml`` adds the
    device and threads, :class:`TrainSettings` the seed and logging). Numbers must be finite:
    ``lr``, ``weight_decay`` or ``l2_margin`` of ``inf`` were accepted and failed mid-run with a
    hint to lower the learning rate."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    epochs: int = Field(2, ge=1)
    batch_size: int = Field(128, ge=4)
    lr: float = Field(1e-3, gt=0)
    optimizer: Literal["adam", "sgd"] = "adam"  # sgd: momentum 0.9
    weight_decay: float = Field(5e-4, ge=0)  # L2 penalty (coupled: its gradient is added to the loss's)
    max_train_pairs: int | None = Field(None, ge=1)
    augment: bool = True  # the paper's flips and 90-degree rotations, the same for both patches
    l2_margin: float = Field(1.0, gt=0)
    triplet_margin: float = Field(1.0, gt=0)  # HardNet's margin
    # decision nets: hinge on o = tanh(z) in [-1, 1] (the paper's Eq. 1) or on the linear z
    # (no saturation: a collapsed constant output still gets a gradient)
    decision_output: Literal["tanh", "linear"] = "tanh"


class TrainSettings(PatchTrainingSettings):
    """One training run of :func:`train_patch_model`: the settings plus its seed and how often
    it logs. A value out of range raises :class:`dmlkit.exceptions.ConfigError`."""

    seed: int = Field(0, ge=0, lt=2**32)  # numpy refuses other seeds
    log_every: int = Field(50, ge=1)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, None, "patch training settings",
                                                      model=type(self))) from None


def _dihedral(x: torch.Tensor, k: int) -> torch.Tensor:
    """One of the 8 flips/rotations by 90 degrees."""
    if k >= 4:
        x = x.flip(-1)
    return torch.rot90(x, k % 4, dims=(-2, -1)) if k % 4 else x


def _optimizer(model: nn.Module, s: TrainSettings) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=s.lr, momentum=0.9, weight_decay=s.weight_decay)
    return torch.optim.Adam(params, lr=s.lr, weight_decay=s.weight_decay)


def train_patch_model(
    model: PatchNet,
    inputs: torch.Tensor,
    pairs: PatchPairs,
    point_ids: np.ndarray,
    settings: TrainSettings,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train ``model`` on one subset; returns the log (one dict per ``log_every`` steps).

    ``inputs`` are all patches of the subset from :func:`prepare_patches`; ``pairs`` its
    training pairs (decision and ``-l2`` nets). ``hardnet`` ignores the pairs' negatives and
    draws batches of ``batch_size / 2`` 3D points with two patches each (HardNet's sampling,
    :class:`dmlkit.samplers.MPerClassSampler`), mined by :class:`dmlkit.miners` ``batch_hard``
    for :class:`dmlkit.losses` ``triplet``. Every architecture gets the same number of steps:
    ``epochs * ceil(len(pairs) / batch_size)``.
    """
    pairs.check_indices(inputs.shape[0], "training pairs")
    if np.shape(point_ids) != (inputs.shape[0],):  # hardnet draws patches by these ids
        raise ShapeError(f"point_ids need one 3D point id per patch: {inputs.shape[0]} patches, "
                         f"point_ids of shape {np.shape(point_ids)}")
    gen = torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    if settings.max_train_pairs is not None and len(pairs) > settings.max_train_pairs:
        pairs = pairs.subset(np.sort(rng.choice(len(pairs), settings.max_train_pairs, replace=False)))
    if len(pairs) < settings.batch_size:
        raise DataError(f"only {len(pairs)} training pairs for a batch of {settings.batch_size}")
    steps_per_epoch = math.ceil(len(pairs) / settings.batch_size)
    opt = _optimizer(model, settings)
    dev = next(model.parameters()).device
    model.train()
    log: list[dict] = []
    left = torch.from_numpy(pairs.left)
    right = torch.from_numpy(pairs.right)
    y = torch.from_numpy(pairs.label).float() * 2.0 - 1.0
    is_hardnet = isinstance(model, HardNetDescriptor)
    if is_hardnet:
        ids, counts = np.unique(point_ids, return_counts=True)
        usable = np.isin(point_ids, ids[counts >= 2])
        rows = np.flatnonzero(usable)
        n_points = int((counts >= 2).sum())
        if n_points < settings.batch_size // 2:  # the sampler's own message names its options, not ours
            raise DataError(
                f"hardnet draws batch_size / 2 = {settings.batch_size // 2} 3D points per batch, but only "
                f"{n_points} points have two or more patches: lower training.batch_size"
            )
        sampler = MPerClassSampler(
            point_ids[rows], samples_per_class=2, classes_per_batch=settings.batch_size // 2,
            batches_per_epoch=steps_per_epoch, seed=settings.seed,
        )
        loss_fn = get_loss("triplet", margin=settings.triplet_margin, reduction="batch_all")
        miner = get_miner("batch_hard")
        labels_all = torch.from_numpy(point_ids)
    l2 = isinstance(model, SiameseNet) and model.l2
    t0 = time.perf_counter()
    step = 0
    for epoch in range(settings.epochs):
        if is_hardnet:
            sampler.set_epoch(epoch)
            batches = [torch.as_tensor(rows[np.asarray(b)]) for b in sampler]
        else:
            perm = torch.randperm(len(pairs), generator=gen)
            batches = [perm[i : i + settings.batch_size] for i in range(0, len(pairs), settings.batch_size)]
        for b in batches:
            k = int(torch.randint(0, 8, (1,), generator=gen)) if settings.augment else 0
            if is_hardnet:
                x = _dihedral(inputs[b].to(dev), k)
                emb = model.describe(x)
                lab = labels_all[b].to(dev)
                loss = loss_fn(emb, lab, miner(emb, lab))
            else:
                a, p = _dihedral(inputs[left[b]].to(dev), k), _dihedral(inputs[right[b]].to(dev), k)
                yb = y[b].to(dev)
                if l2:
                    loss = hinge_embedding_loss(model(a, p), yb, settings.l2_margin)
                else:
                    o = model.logits(a, p) if settings.decision_output == "linear" else model(a, p)
                    loss = hinge_loss(o, yb)
            if not torch.isfinite(loss):
                raise NonFiniteError(f"{model.name}: the loss became {loss.item()} at step {step}: lower the learning rate")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % settings.log_every == 0 or step == steps_per_epoch * settings.epochs:
                rec = {"event": "train", "epoch": epoch, "step": step, "loss": float(loss.detach()), "time": time.perf_counter() - t0}
                log.append(rec)
                if progress is not None:
                    progress(rec)
    model.eval()
    return log


@torch.no_grad()
def score_pairs(model: PatchNet, inputs: torch.Tensor, pairs: PatchPairs, batch_size: int = 1024) -> np.ndarray:
    """Score of every pair (higher = match), float64 ``(len(pairs),)``.

    Networks with descriptors describe each distinct patch once and score pairs from the
    descriptors (``n + m`` branch passes); 2-channel networks run once per pair. Every pair
    index must point at a patch of ``inputs`` (:meth:`PatchPairs.check_indices`).
    """
    pairs.check_indices(inputs.shape[0], "pairs to score")
    model.eval()
    dev = next(model.parameters()).device
    left = torch.from_numpy(pairs.left)
    right = torch.from_numpy(pairs.right)
    out = torch.empty(len(pairs), dtype=torch.float64)
    if getattr(model, "has_descriptor", False):
        used = torch.unique(torch.cat([left, right]))
        pos = torch.full((inputs.shape[0],), -1, dtype=torch.int64)
        pos[used] = torch.arange(len(used))
        sides = []
        for side in (0, 1):
            if side == 1 and not (isinstance(model, SiameseNet) and not model.shared):
                sides.append(sides[0])
                continue
            sides.append(torch.cat([
                model.describe(inputs[used[i : i + batch_size]].to(dev), side) for i in range(0, len(used), batch_size)
            ]))
        for i in range(0, len(pairs), batch_size * 4):
            sl = slice(i, i + batch_size * 4)
            out[sl] = model.decide(sides[0][pos[left[sl]].to(dev)], sides[1][pos[right[sl]].to(dev)]).double().cpu()
    else:
        for i in range(0, len(pairs), batch_size):
            sl = slice(i, i + batch_size)
            out[sl] = model.score(inputs[left[sl]].to(dev), inputs[right[sl]].to(dev)).double().cpu()
    scores = out.numpy()
    if not np.all(np.isfinite(scores)):
        raise NonFiniteError(f"{model.name} produced non-finite scores: the model diverged; retrain with a lower lr")
    return scores
