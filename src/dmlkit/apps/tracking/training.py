"""Training SiamFC on pairs of frames (Bertinetto et al. 2016, Sec. 2.2 and 4.1).

A training pair is an exemplar z (127 x 127, the target in frame a with context) and a search
image x (255 x 255, centred near the target in frame b, ``|a - b| <= T``) of one sequence. Every
position u of the 17 x 17 score map is a sample with label

    y[u] = +1  if  k * ||u - c|| <= R  (k = 8 the network stride, c = the target's cell),
           -1  otherwise

and the loss is the class-balanced mean of the logistic loss, Eq. (2)-(3) of the paper:

    L(y, v) = sum_u w[u] * log(1 + exp(-y[u] v[u])),   w = 1/(2 |pos|) on positives,
                                                           1/(2 |neg|) on negatives,

averaged over the batch (``softplus(-y v)`` evaluates ``log(1 + exp(-y v))`` stably).
Augmentation follows the public SiamFC training code: a random stretch of the crop sides
(+-5 %), a random shift of the target in the search image (+-``max_shift`` pixels, the labels
follow it) and gray-scale pairs with probability 0.25. Optimiser: SGD, momentum 0.9, weight
decay 5e-4, learning rate decayed geometrically from ``lr`` to ``lr_end`` (the paper: 1e-2 to
1e-5 over 50 epochs of 53,200 pairs; the CPU configs here run far fewer pairs).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dmlkit.apps.tracking.datasets import Sequence, load_tracking_dataset
from dmlkit.apps.tracking.geometry import (
    box_to_center,
    crop_and_resize,
    exemplar_side,
    image_to_tensor,
)
from dmlkit.apps.tracking.model import EXEMPLAR_SIZE, INSTANCE_SIZE, TOTAL_STRIDE, SiamFC
from dmlkit.apps.tracking.tracker import TrackerConfig, tracker_config
from dmlkit.config import StrictNumbers, apply_dict_overrides, read_yaml_mapping, validate_settings
from dmlkit.embeddings import resolve_device
from dmlkit.exceptions import CheckpointError, ConfigError, DataError, NonFiniteError, ShapeError
from dmlkit.limits import MAX_THREADS
from dmlkit.models import to_device
from dmlkit.models.trunks import load_failure_reason
from dmlkit.provenance import write_provenance
from dmlkit.signals import ignore_stop_signals, signals_deferred
from dmlkit.training.checkpoint import refuse_fresh_start
from dmlkit.utils import (
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
    directory_lock,
    dotted_items,
    open_appending,
    seed_everything,
)
from dmlkit.validation import check_seed

CHECKPOINT_FORMAT = "dmlkit-siamfc-v1"


def make_labels(
    response_size: int = 17, stride: int = TOTAL_STRIDE, radius: float = 16.0,
    shift: tuple[float, float] = (0.0, 0.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels (+1 / -1) and class-balanced weights of one score map.

    ``shift`` is the target's offset ``(dy, dx)`` from the search image centre in search-image
    pixels. Position u is positive iff ``||stride * (u - centre) - shift|| <= radius``. The
    weights are ``1 / (2 #pos)`` on positives and ``1 / (2 #neg)`` on negatives (sum 1).
    ``radius`` and ``shift`` must be finite (an infinite radius made every label +1).
    """
    if response_size < 1 or stride < 1 or not 0 <= radius < math.inf:
        raise ConfigError("make_labels needs response_size >= 1, stride >= 1 and a finite radius >= 0, "
                          f"got {response_size}, {stride}, {radius}")
    if not all(math.isfinite(float(v)) for v in shift):
        raise ConfigError(f"make_labels needs a finite shift, got {tuple(shift)}")
    r = torch.arange(response_size, dtype=torch.float64) - (response_size - 1) / 2.0
    dy = stride * r[:, None] - float(shift[0])
    dx = stride * r[None, :] - float(shift[1])
    pos = (dy**2 + dx**2).sqrt() <= radius
    labels = torch.where(pos, 1.0, -1.0)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    weights = torch.zeros_like(labels)
    if n_pos:
        weights[pos] = 0.5 / n_pos if n_neg else 1.0 / n_pos
    if n_neg:
        weights[~pos] = 0.5 / n_neg if n_pos else 1.0 / n_neg
    return labels.float(), weights.float()


def logistic_loss(scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``mean_b sum_u w[b, u] log(1 + exp(-y[b, u] v[b, u]))`` (SiamFC Eq. 2-3)."""
    if scores.shape != labels.shape or scores.shape != weights.shape:
        raise ShapeError(
            f"scores {tuple(scores.shape)}, labels {tuple(labels.shape)} and weights "
            f"{tuple(weights.shape)} must have the same shape"
        )
    per_map = (weights * F.softplus(-labels * scores)).flatten(1).sum(dim=1)
    return per_map.mean()


class PairConfig(BaseModel):
    """How training pairs are drawn and augmented (numbers finite: ``max_shift: inf`` ended in a
    traceback mid-run, and ``radius: inf`` trained on labels that are +1 everywhere)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_frame_gap: int = Field(100, ge=0, description="T: frames a and b at most T apart")
    context: float = Field(0.5, gt=0)
    radius: float = Field(16.0, ge=0, description="R: positive radius in search-image pixels")
    max_shift: float = Field(8.0, ge=0, description="random target shift in the search image")
    stretch: float = Field(0.05, ge=0, lt=1, description="random crop-side stretch (fraction)")
    gray_prob: float = Field(0.25, ge=0, le=1)


class SiamFCPairs(torch.utils.data.Dataset):
    """Random (exemplar, search, labels, weights) pairs from annotated sequences.

    Item ``i`` of epoch ``e`` is a pure function of ``(seed, e, i)``: a sequence (chosen in
    proportion to its number of valid frames), two valid frames at most ``T`` apart, the crops
    and the augmentation. ``len`` is ``pairs_per_epoch``.
    """

    def __init__(self, sequences: list[Sequence], pairs_per_epoch: int, config: PairConfig | None = None,
                 seed: int = 0) -> None:
        self.config = config or PairConfig()
        usable = [s for s in sequences if s.boxes is not None and s.valid.sum() >= 2]
        if not usable:
            raise DataError("SiamFC training needs sequences with at least two annotated frames")
        if pairs_per_epoch < 1:
            raise ConfigError(f"pairs_per_epoch must be >= 1, got {pairs_per_epoch}")
        self.sequences = usable
        self.valid_idx = [np.flatnonzero(s.valid) for s in usable]
        counts = np.array([len(v) for v in self.valid_idx], dtype=np.float64)
        self.seq_prob = counts / counts.sum()
        self.pairs_per_epoch = int(pairs_per_epoch)
        self.seed = check_seed(seed)  # numpy's default_rng refuses a negative one mid-epoch
        self.epoch = 0
        self.response_size = (INSTANCE_SIZE - EXEMPLAR_SIZE) // TOTAL_STRIDE + 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.pairs_per_epoch

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        c = self.config
        rng = np.random.default_rng([self.seed, self.epoch, int(i)])
        s = int(rng.choice(len(self.sequences), p=self.seq_prob))
        seq, valid = self.sequences[s], self.valid_idx[s]
        a = int(rng.choice(valid))
        near = valid[(np.abs(valid - a) <= c.max_frame_gap) & (valid != a)]
        b = int(rng.choice(near)) if len(near) else a
        img_a = image_to_tensor(seq.frame(a))
        img_b = img_a if b == a else image_to_tensor(seq.frame(b))
        center_a, size_a = box_to_center(seq.boxes[a])
        center_b, size_b = box_to_center(seq.boxes[b])
        z_side = exemplar_side(size_a, c.context) * (1.0 + rng.uniform(-c.stretch, c.stretch))
        x_side = (exemplar_side(size_b, c.context) * INSTANCE_SIZE / EXEMPLAR_SIZE
                  * (1.0 + rng.uniform(-c.stretch, c.stretch)))
        shift = rng.uniform(-c.max_shift, c.max_shift, size=2)  # target offset in x, pixels
        crop_center = center_b - shift * x_side / INSTANCE_SIZE
        z = crop_and_resize(img_a, center_a, z_side, EXEMPLAR_SIZE)[0]
        x = crop_and_resize(img_b, crop_center, x_side, INSTANCE_SIZE)[0]
        if rng.random() < c.gray_prob:
            w = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
            z = (z * w).sum(0, keepdim=True).expand(3, -1, -1).contiguous()
            x = (x * w).sum(0, keepdim=True).expand(3, -1, -1).contiguous()
        labels, weights = make_labels(self.response_size, TOTAL_STRIDE, c.radius, tuple(shift))
        return z, x, labels[None], weights[None]


class SiamFCTrainConfig(StrictNumbers):
    """The ``configs/siamfc*.yaml`` schema: data, model width, pairs, optimiser (numbers finite:
    ``lr: inf`` trained a model of NaN weights that then tracked to a confident score)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    seed: int = Field(0, ge=0, lt=2**32)  # numpy refuses other seeds (after the run was written)
    dataset: str = Field("got10k", description="otb | got10k layout")
    data_dir: str = Field(..., description="root of the training sequences")
    split: str | None = Field(None, description="GOT-10k sub-folder (train)")
    index_base: int | None = Field(None, ge=0, le=1, description="index of the first pixel in the ground-truth "
                                   "files: 1 for GOT-10k and OTB; None: 1, or what a build-data's meta.json records")
    width: float = Field(1.0, gt=0, le=4, description="backbone channel multiplier (1 = paper)")
    epochs: int = Field(1, ge=1)
    pairs_per_epoch: int = Field(1000, ge=1)
    batch_size: int = Field(8, ge=1)
    lr: float = Field(1e-2, gt=0)
    lr_end: float = Field(1e-5, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    num_workers: int = Field(0, ge=0)
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="torch CPU threads (None: torch's default)")
    device: str = Field("cpu", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto, cpu, cuda or cuda:N")
    pairs: PairConfig = Field(default_factory=PairConfig)
    tracker: dict[str, Any] = Field(default_factory=dict, description="TrackerConfig overrides")

    @field_validator("tracker")
    @classmethod
    def _tracker_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        """The tracker's keys and values are checked when the config is read."""
        tracker_config(value)
        return value

    @model_validator(mode="after")
    def _decaying_lr(self) -> SiamFCTrainConfig:
        if self.lr_end > self.lr:
            raise ValueError(f"lr_end ({self.lr_end}) must not exceed lr ({self.lr}): the rate decays")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> SiamFCTrainConfig:
        data = read_yaml_mapping(path, "SiamFC training settings", "configs/siamfc_offline.yaml")
        return validate_settings(cls, apply_dict_overrides(data, overrides), "SiamFC config", str(path))


def save_siamfc(path: str | Path, model: SiamFC, tracker: TrackerConfig | None = None,
                extra: dict[str, Any] | None = None,
                train_state: dict[str, Any] | None = None) -> Path:
    """Write a SiamFC checkpoint (state dict, width, tracker hyper-parameters) atomically.

    ``train_state`` (optimiser, scheduler, shuffling generator, epoch, step, losses) lets
    :func:`train_siamfc` resume; everything in it loads with ``weights_only=True``.
    """
    state = {
        "format": CHECKPOINT_FORMAT,
        "width": float(model.width),
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "tracker": (tracker or TrackerConfig()).to_dict(),
        "extra": json.loads(json.dumps(extra or {}, default=str)),
    }
    if train_state is not None:
        state["train_state"] = train_state
    return atomic_torch_save(state, path)


def load_siamfc(path: str | Path, map_location: str = "cpu") -> tuple[SiamFC, TrackerConfig]:
    """Read a checkpoint of :func:`save_siamfc` (or a run directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoints" / "last.pt"
    if not path.is_file():
        raise CheckpointError(f"SiamFC checkpoint {path} does not exist: train one with "
                              "`dmlkit track train CONFIG`")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read SiamFC checkpoint {path}: {load_failure_reason(exc)}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a dmlkit SiamFC checkpoint ({CHECKPOINT_FORMAT})")
    model = SiamFC(width=float(state["width"]))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: weights do not fit the SiamFC network: {exc}") from None
    return model.eval(), TrackerConfig(**state.get("tracker", {}))


#: Config keys a resumed run may change: how it runs, not what it learns.
RESUMABLE_SETTINGS = ("threads", "num_workers", "device")
#: What a run writes besides its checkpoint, config.yaml and provenance.json: removed when a run
#: starts afresh in a folder an attempt killed before its first checkpoint left.
RUN_OUTPUTS = ("log.jsonl", "metrics.json")
#: The lock a run holds in its run directory: the name ``dmlkit train``'s lock has.
RUN_LOCK = "train.lock"


def config_changes(recorded: dict[str, Any], config: SiamFCTrainConfig) -> list[str]:
    """The keys (dotted: ``pairs.radius``) whose values differ between a run's recorded config
    (its ``config.yaml``, defaults filled in) and ``config``, but :data:`RESUMABLE_SETTINGS`;
    ``data_dir`` is compared as a resolved path."""
    try:
        recorded = SiamFCTrainConfig.model_validate(recorded).model_dump()
    except Exception:  # a key this version no longer has: compared as written
        pass
    old, new = dotted_items(recorded), dotted_items(config.model_dump())
    missing = object()
    changed = []
    for key in sorted(set(old) | set(new)):
        if key.split(".")[0] in RESUMABLE_SETTINGS:
            continue
        a, b = old.get(key, missing), new.get(key, missing)
        if key == "data_dir" and a is not missing and b is not missing:
            a, b = Path(str(a)).expanduser().resolve(), Path(str(b)).expanduser().resolve()
        if a != b:
            changed.append(key)
    return changed


def data_digest(sequences: list[Sequence]) -> str:
    """A digest of training sequences: their names, frame counts and boxes (not where they lie)."""
    h = hashlib.sha256()
    for seq in sequences:
        h.update(f"{seq.name}\0{len(seq)}\0".encode())
        if seq.boxes is not None:
            h.update(np.ascontiguousarray(seq.boxes, dtype=np.float64).tobytes())
    return h.hexdigest()


def _unconverted(sequences: list[Sequence]) -> list[Sequence]:
    """``sequences`` with the boxes as their files hold them (dmlkit before the 1-based
    conversion read them so): the index base added back to ``x`` and ``y``."""
    return [Sequence(s.name, s.frames, None if s.boxes is None else s.boxes + ([s.index_base or 0] * 2 + [0, 0]))
            for s in sequences]


def _check_resumable(run_dir: Path, state: dict[str, Any], config: SiamFCTrainConfig,
                     sequences: list[Sequence]) -> None:
    """A run resumes with the config and the data it was started with (:class:`ConfigError`),
    and with a checkpoint trained under that config (:class:`CheckpointError`)."""
    import yaml

    config_path = run_dir / "config.yaml"
    try:
        recorded = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        recorded = None
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{config_path} is missing or unreadable: the config this run was started with "
                              "is unknown, so it cannot be resumed; train again without --resume")
    changed = config_changes(recorded, config)
    if changed:
        raise ConfigError(f"cannot resume {run_dir}: the config differs from the one it was started with in "
                          f"{', '.join(changed)}; resume with {config_path} (only {', '.join(RESUMABLE_SETTINGS)} "
                          "may change) or train into a new --run-dir")
    trained_with = state["train_state"].get("config")  # absent in checkpoints of older versions
    changed = config_changes(trained_with, config) if isinstance(trained_with, dict) else []
    if changed:
        raise CheckpointError(f"cannot resume {run_dir}: its checkpoints/last.pt was trained with another config "
                              f"than {config_path} (they differ in {', '.join(changed)}); train into a new --run-dir")
    digest = state["train_state"].get("data_digest")
    if digest is not None and digest != data_digest(sequences) and digest == data_digest(_unconverted(sequences)):
        raise ConfigError(f"cannot resume {run_dir}: it was started by an older dmlkit, which read the 1-based boxes "
                          f"of the files under {config.data_dir} as 0-based (every exemplar one pixel off): train "
                          "it again into a new --run-dir")
    if digest is not None and digest != data_digest(sequences):
        raise ConfigError(f"cannot resume {run_dir}: its training sequences differ from those it was started "
                          f"with ({len(sequences)} now, under {config.data_dir}); resume on the same data or "
                          "train into a new --run-dir")


def train_siamfc(
    config: SiamFCTrainConfig, run_dir: str | Path, sequences: list[Sequence] | None = None,
    progress: bool = True, resume: bool = False, max_epochs: int | None = None,
) -> dict[str, Any]:
    """Train SiamFC; writes ``run_dir/{config.yaml, provenance.json, log.jsonl, checkpoints/last.pt}``.

    ``checkpoints/last.pt`` is written after every epoch with the optimiser, scheduler and
    shuffling state: ``resume=True`` continues an interrupted run from its last finished epoch
    and gives the same weights as an uninterrupted run. It needs that checkpoint
    (:class:`CheckpointError` otherwise: a misspelt run directory trained from scratch), the
    config of the run's ``config.yaml`` but :data:`RESUMABLE_SETTINGS` and the same training
    sequences (:func:`data_digest`; a :class:`ConfigError` naming what differs), and a checkpoint
    that records that config. Without ``resume`` a ``run_dir`` that holds a run is refused, as
    ``dmlkit train`` refuses it (:func:`~dmlkit.training.checkpoint.refuse_fresh_start`): a new
    config.yaml beside the old checkpoint would pair the two. ``max_epochs`` stops this call after
    that many epochs (train a CPU budget in chunks, then resume). Returns ``{"steps", "epochs",
    "pairs", "seconds", "first_loss", "last_loss", "checkpoint"}``; the losses are means over
    the first and last 10 % of the steps so far. A fresh start and a resume hold
    ``run_dir/train.lock`` (:func:`~dmlkit.utils.directory_lock`) for the whole run: a second
    ``train_siamfc`` into ``run_dir`` meanwhile is refused, as a second ``dmlkit train`` is.
    """
    run_dir = Path(run_dir)
    # two runs at once interleaved log.jsonl and mixed last.pt, config.yaml and metrics.json
    with directory_lock(run_dir, RUN_LOCK, f"another `dmlkit track train` is using {run_dir}: wait for it "
                        "to end, or choose another run directory (--run-dir)"):
        return _train_in_dir(config, run_dir, sequences, progress, resume, max_epochs)


def _train_in_dir(config: SiamFCTrainConfig, run_dir: Path, sequences: list[Sequence] | None,
                  progress: bool, resume: bool, max_epochs: int | None) -> dict[str, Any]:
    """:func:`train_siamfc` in ``run_dir``, whose lock the caller holds."""
    import yaml

    ckpt_path = run_dir / "checkpoints" / "last.pt"
    if resume and not ckpt_path.is_file():  # else a fresh run, silently (a misspelt --run-dir)
        raise CheckpointError(f"nothing to resume in {run_dir}: it holds no checkpoints/last.pt (no epoch of a "
                              "run there has finished); train without --resume to start one")
    if not resume:
        refuse_fresh_start(run_dir, RUN_OUTPUTS)
    seed_everything(config.seed)
    if config.threads:
        torch.set_num_threads(config.threads)
    if sequences is None:
        sequences = load_tracking_dataset(config.dataset, config.data_dir, config.split, config.index_base)
    tracker_cfg = tracker_config(config.tracker)
    pairs = SiamFCPairs(sequences, config.pairs_per_epoch, config.pairs, seed=config.seed)
    device = resolve_device(config.device)
    # created once the data, the tracker settings and the device are known good: a refused run
    # (a misspelt data_dir, cuda without a GPU) leaves no empty run directory behind
    run_dir.mkdir(parents=True, exist_ok=True)
    model = to_device(SiamFC(width=config.width), device)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(len(pairs) / config.batch_size)
    total = steps_per_epoch * config.epochs
    gamma = (config.lr_end / config.lr) ** (1.0 / max(1, total - 1))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma)
    gen = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    start_epoch, step, elapsed = 0, 0, 0.0
    log_path = run_dir / "log.jsonl"
    if resume:
        try:
            state = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: one line, not a traceback
            raise CheckpointError(f"cannot read checkpoint {ckpt_path} to resume from: {load_failure_reason(exc)}") from None
        ts = state.get("train_state") if isinstance(state, dict) else None
        if ts is None or state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{ckpt_path} holds no training state to resume from: "
                                  "train again without --resume")
        _check_resumable(run_dir, state, config, pairs.sequences)
        if float(state["width"]) != float(config.width):
            raise CheckpointError(f"{ckpt_path} has width {state['width']} but the config "
                                  f"says {config.width}: resume with the run's config.yaml")
        model.load_state_dict(state["model"])
        opt.load_state_dict(ts["optimizer"])
        sched.load_state_dict(ts["scheduler"])
        gen.set_state(ts["generator"])
        start_epoch, step = int(ts["epoch"]), int(ts["step"])
        losses, elapsed = [float(v) for v in ts["losses"]], float(ts["seconds"])
        lines = log_path.read_text().splitlines() if log_path.is_file() else []
        atomic_write_text(log_path, "".join(line + "\n" for line in lines[:step]))  # never through a link out of RUN
    else:
        atomic_write_text(run_dir / "config.yaml",
                          yaml.safe_dump(config.model_dump(), sort_keys=False))
        write_provenance(run_dir / "provenance.json", config.seed)
        (run_dir / "metrics.json").unlink(missing_ok=True)  # an earlier attempt's, if any
        atomic_write_text(log_path, "")  # a planted link out of RUN: refused (link_target_inside)
    end_epoch = config.epochs if max_epochs is None else min(config.epochs, start_epoch + max_epochs)
    t_start = time.perf_counter() - elapsed
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc="siamfc", unit="step")
    digest = data_digest(pairs.sequences)
    model.train()
    with open_appending(log_path, encoding="utf-8") as log:
        for epoch in range(start_epoch, end_epoch):
            pairs.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(
                pairs, batch_size=config.batch_size, shuffle=True, generator=gen,
                num_workers=config.num_workers, drop_last=False, worker_init_fn=ignore_stop_signals,
            )
            with signals_deferred():  # a Ctrl-C / SIGTERM while the workers fork is not lost
                batches = iter(loader)
            for z, x, labels, weights in batches:
                z, x = z.to(device), x.to(device)
                labels, weights = labels.to(device), weights.to(device)
                loss = logistic_loss(model(z, x), labels, weights)
                if not torch.isfinite(loss):
                    raise NonFiniteError(f"SiamFC loss became {loss.item()} at step {step}: "
                                         "lower the learning rate (lr) in the config")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                lr = opt.param_groups[0]["lr"]
                sched.step()
                step += 1
                losses.append(float(loss.detach()))
                log.write(json.dumps({"event": "train", "epoch": epoch, "step": step,
                                      "loss": losses[-1], "lr": lr,
                                      "time": time.perf_counter() - t_start}) + "\n")
                log.flush()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if not all(torch.isfinite(p).all() for p in model.parameters()):  # never saved
                raise NonFiniteError(f"the SiamFC weights became NaN or infinite by step {step} (epoch "
                                     f"{epoch + 1}): lower the learning rate (lr) in the config")
            train_state = {
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "generator": gen.get_state(), "epoch": epoch + 1, "step": step,
                "losses": losses, "seconds": time.perf_counter() - t_start, "data_digest": digest,
                "config": config.model_dump(),
            }
            save_siamfc(ckpt_path, model, tracker_cfg,
                        {"epoch": epoch + 1, "step": step, "seed": config.seed}, train_state)
    if bar is not None:
        bar.close()
    if not losses:
        raise CheckpointError(f"{run_dir} has already finished all {config.epochs} epochs")
    k = max(1, len(losses) // 10)
    result = {
        "steps": step, "epochs": end_epoch, "pairs": len(pairs) * end_epoch,
        "seconds": time.perf_counter() - t_start,
        "first_loss": float(np.mean(losses[:k])), "last_loss": float(np.mean(losses[-k:])),
        "checkpoint": str(ckpt_path),
    }
    atomic_write_json(run_dir / "metrics.json", result)
    return result
