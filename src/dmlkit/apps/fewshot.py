"""Few-shot classification with an embedding: nearest class prototype (Snell et al. 2017).

* :func:`prototype_predict` - label of the nearest class mean of the support embeddings.
* :func:`few_shot_accuracy` - N-way K-shot accuracy over random episodes (drawn by
  :class:`dmlkit.samplers.EpisodeSampler`) with a 95 % Student-t confidence interval.
* :func:`load_omniglot_one_shot_runs` / :func:`omniglot_one_shot_error` - the 20 official
  20-way one-shot runs of Lake et al. (Science 2015), scored as classification error.
"""

from __future__ import annotations

import io
import os
import re
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlkit.data import get_transforms
from dmlkit.data.base import ArrayDataset
from dmlkit.distances import LpDistance, get_distance
from dmlkit.embeddings import resolve_device
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError, ShapeError
from dmlkit.losses.prototypical import class_means, distance_to_centres
from dmlkit.protocol.stats import mean_ci
from dmlkit.samplers import EpisodeSampler, split_episode
from dmlkit.training import embed_split, load_checkpoint
from dmlkit.utils import data_root
from dmlkit.validation import check_embeddings, check_labels

if TYPE_CHECKING:
    import torch

    from dmlkit.config import ExperimentConfig

__all__ = [
    "OneShotRun",
    "checkpoint_image_embedder",
    "few_shot_accuracy",
    "load_omniglot_one_shot_runs",
    "model_image_embedder",
    "omniglot_one_shot_error",
    "prototype_predict",
]


def prototype_predict(support: Any, support_labels: Any, query: Any, distance: str = "euclidean") -> np.ndarray:
    """Predicted label of each query: the class whose prototype (support mean) is closest.

    ``distance="euclidean"`` is the squared-Euclidean rule of prototypical networks;
    ``"cosine"`` compares directions (either in any case; other names are refused). Prototypes and distances are computed in float64 from the
    float32 embeddings (:func:`_prototype_closeness`); a query equally close to two prototypes
    takes the class that sorts first (ties by index, as in the kNN metrics).
    """
    s = check_embeddings(support, "support embeddings").cpu()
    codes, names = check_labels(support_labels, len(s), "support labels")
    classes, closeness = _prototype_closeness(s, codes, query, distance)
    pred = classes[closeness.argmax(1)]
    return pred if names is None else np.asarray(names)[pred]


def _prototype_closeness(support: Any, codes: np.ndarray, query: Any, distance: str) -> tuple[np.ndarray, np.ndarray]:
    """``(classes, closeness)``: the support's classes (sorted) and each query's closeness to
    their prototypes (larger = closer: minus a distance), ``(queries, classes)``.

    In float64: the squared Euclidean distance is ``|x|^2 + |c|^2 - 2 x.c``, whose float32
    rounding grows with ``|x|^2``, so embeddings sharing an offset (all near ``10 + noise``, 512
    dimensions) gave a prototype 1e-4 relatively farther in exact arithmetic and moved the
    accuracy with the offset, which cannot change a distance (5-way 1-shot, 1,000 episodes:
    0.39820 at offset 0, 0.39788 at offset 10; float64 gives 0.39820 at both)."""
    import torch

    dist = _distance(distance)
    s = check_embeddings(support, "support embeddings").cpu().double()
    q = check_embeddings(query, "query embeddings").cpu().double()
    if q.shape[1] != s.shape[1]:
        raise ShapeError(f"query embeddings have {q.shape[1]} dimensions but the support has {s.shape[1]}")
    with torch.no_grad():
        classes, centres, _ = class_means(dist.normalize(s), torch.as_tensor(codes))
        d = distance_to_centres(dist, dist.normalize(q), centres)
    return classes.numpy(), (d if dist.higher_is_closer else -d).numpy()


def _tie_ruled_answers(classes: np.ndarray, closeness: np.ndarray, truth: np.ndarray) -> int:
    """How many queries have their true class among two or more equally closest prototypes
    (``closeness`` of :func:`_prototype_closeness`): class order, not the embeddings, decides
    whether they are answered right. A tie among other classes only is a wrong answer either way."""
    best = closeness.max(1, keepdims=True)
    own = closeness[np.arange(len(truth)), np.searchsorted(classes, truth)]
    return int(((own == best[:, 0]) & ((closeness == best).sum(1) > 1)).sum())


def _distance(distance: str):
    """``euclidean``: squared Euclidean on raw embeddings (prototypical networks); ``cosine``
    compares directions. Read in any case. Any other name is refused: ``dot`` or ``snr`` would
    score otherwise than the documented rules, and :func:`dmlkit.distances.get_distance`'s ``lp``
    is the *normalised* Euclidean, which is ``cosine``'s ranking, not ``euclidean``'s."""
    name = distance.strip().lower() if isinstance(distance, str) else None
    if name == "euclidean":
        return LpDistance(power=2, normalize_embeddings=False)
    if name == "cosine":
        return get_distance(name)
    raise ConfigError(f"unknown distance {distance!r} for few-shot classification (--distance): use "
                      "'euclidean' (squared Euclidean of the raw embeddings, prototypical networks) or 'cosine'")


#: How ``dmlkit fewshot`` spells the arguments of :func:`few_shot_accuracy` (for its messages).
_CLI_NAMES = "dmlkit fewshot: n_way = --way, k_shot = --shot, n_query = --queries, episodes = --episodes"


def few_shot_accuracy(embeddings: Any, labels: Any, n_way: int = 5, k_shot: int = 1, n_query: int = 5,
                      episodes: int = 1000, distance: str = "euclidean", seed: int = 0) -> dict[str, Any]:
    """Mean N-way K-shot accuracy over episodes, with the 95 % CI half-width (Student t).

    ``ci95 = t_{0.975, E-1} * s / sqrt(E)`` with ``s`` the ``ddof=1`` standard deviation of the
    ``E`` episode accuracies (:func:`dmlkit.protocol.stats.mean_ci`): the interval prototypical
    networks report (Snell et al. 2017) with the t quantile in place of 1.96, which covered
    80 % at 3 episodes (1.96 and t agree to 0.1 % from 1,000 episodes on). NaN for a single
    episode (no spread to estimate; JSON ``null``). A warning says when the interval says
    nothing: one episode, or episodes that all scored alike (``ci95`` 0 while the accuracy is
    uncertain; more episodes tell).

    Episodes draw only classes with at least ``k_shot + n_query`` items: the result's
    ``classes_used`` / ``classes_skipped`` count them and the others, and a warning says when
    classes were skipped (the accuracy then describes the larger classes only). ``n_way < 2``
    is refused (one class per episode: every query is right). Embeddings with NaN/infinite rows
    are refused (:mod:`dmlkit.validation`), as by ``evaluate``, instead of scoring them as if
    they were wrong answers. ``distance``: ``"euclidean"`` (squared, raw embeddings: the
    prototypical-network rule) or ``"cosine"``, in any case (:func:`prototype_predict`).
    """
    x = check_embeddings(embeddings).cpu().numpy()
    y, _ = check_labels(labels, len(x))
    _distance(distance)
    if int(n_way) < 2:
        raise ConfigError(f"few-shot accuracy needs n_way >= 2 classes per episode, got {n_way} (--way): "
                          "with one class every query is trivially right")
    if int(n_query) < 1:
        raise ConfigError(f"few-shot accuracy needs at least one query per class, got n_query={n_query} (--queries)")
    try:
        sampler = EpisodeSampler(y, n_way, k_shot, n_query, episodes, seed=seed)
    except (ConfigError, DataError) as exc:  # the sampler names its arguments; say the CLI's too
        raise type(exc)(f"{exc} ({_CLI_NAMES})") from None
    used, total = len(sampler.classes), len(np.unique(y))
    if used < total:
        warnings.warn(
            f"few-shot: {total - used} of {total} classes have fewer than k_shot + n_query = "
            f"{k_shot + n_query} items and are in no episode; the accuracy describes the other {used} "
            "(lower k_shot / n_query, --shot / --queries, to include them)", UserWarning, stacklevel=2)
    accs, tie_ruled = [], 0
    for episode in sampler:
        idx = np.asarray(episode)
        s_idx, q_idx = split_episode(idx, n_way, k_shot, n_query)
        classes, closeness = _prototype_closeness(x[s_idx], y[s_idx], x[q_idx], distance)
        accs.append(float((classes[closeness.argmax(1)] == y[q_idx]).mean()))
        tie_ruled += _tie_ruled_answers(classes, closeness, y[q_idx])
    if tie_ruled:
        warnings.warn(
            f"few-shot: {tie_ruled} of {len(accs) * n_way * n_query} queries are exactly as close to "
            "another class's prototype as to their own nearest one; the class that sorts first is "
            "taken, so those answers come from the order of the labels, not from the embeddings "
            "(collapsed or duplicated embeddings?)", UserWarning, stacklevel=2)
    mean, ci = mean_ci(accs)
    _warn_uninformative_ci(len(accs), ci)
    return {"accuracy": mean, "ci95": float("nan") if ci is None else ci, "episodes": len(accs),
            "n_way": n_way, "k_shot": k_shot, "n_query": n_query,
            "classes_used": used, "classes_skipped": total - used}


def _warn_uninformative_ci(episodes: int, ci: float | None) -> None:
    """Warn when the episodes' 95 % CI cannot say how uncertain the accuracy is: one episode
    (no interval), or a zero-width interval (every episode scored the same; 3 episodes of
    well-separated classes printed "ci95 0.00" for an accuracy below 100 %)."""
    if ci is None or ci == 0.0:
        what = "one episode gives no 95 % CI" if ci is None else \
            f"all {episodes} episodes scored the same, so the 95 % CI has zero width"
        warnings.warn(f"few-shot: {what}; the accuracy is not known that well (use more --episodes)",
                      UserWarning, stacklevel=3)


@dataclass
class OneShotRun:
    """One official run: 20 training images (one per class) and 20 test images."""

    name: str
    train_images: np.ndarray  # (20, 105, 105) bool, True = background
    test_images: np.ndarray  # (20, 105, 105) bool
    answers: np.ndarray  # (20,) index of the correct training image for each test image


_LINE = re.compile(r"(run\d+)/test/item(\d+)\.png\s+(run\d+)/training/class(\d+)\.png")


def load_omniglot_one_shot_runs(root: str | os.PathLike | None = None) -> list[OneShotRun]:
    """The 20 one-shot runs from ``omniglot/one_shot_all_runs.zip`` (or an extracted folder).

    Images are read as the Omniglot dataset reads them (``L`` mode, ``>= 128`` = background).
    """
    from PIL import Image

    base = data_root(root)
    candidates = [base / "omniglot" / "one_shot_all_runs.zip", base / "one_shot_all_runs.zip"]
    zpath = next((c for c in candidates if c.exists()), None)
    if zpath is None:
        raise DataNotFoundError(
            f"Omniglot one-shot runs not found under {base}: put one_shot_all_runs.zip (from "
            "github.com/brendenlake/omniglot, python/one-shot-classification/all_runs.zip) in "
            f"{base / 'omniglot'}"
        )

    def read(zf: zipfile.ZipFile, name: str) -> np.ndarray:
        with Image.open(io.BytesIO(zf.read(name))) as img:
            return np.asarray(img.convert("L")) >= 128

    runs = []
    with zipfile.ZipFile(zpath) as zf:
        names = set(zf.namelist())
        for r in range(1, 21):
            run = f"run{r:02d}"
            if f"{run}/class_labels.txt" not in names:
                raise DataError(f"{zpath} has no {run}/class_labels.txt: the archive is incomplete")
            pairs = _LINE.findall(zf.read(f"{run}/class_labels.txt").decode())
            if len(pairs) != 20:
                raise DataError(f"{zpath}:{run}/class_labels.txt lists {len(pairs)} items, expected 20")
            test = np.stack([read(zf, f"{run}/test/item{int(t):02d}.png") for _, t, _, _ in pairs])
            train = np.stack([read(zf, f"{run}/training/class{c:02d}.png") for c in range(1, 21)])
            answers = np.array([int(c) - 1 for _, _, _, c in pairs])
            runs.append(OneShotRun(run, train, test, answers))
    return runs


def omniglot_one_shot_error(embed: Callable[[np.ndarray], np.ndarray], runs: list[OneShotRun],
                            distance: str = "cosine") -> dict[str, Any]:
    """Classification error (%) on the one-shot runs: each test image takes the class of its
    nearest training image. ``embed`` maps ``(n, 105, 105)`` bool images to ``(n, D)``;
    ``distance`` is ``"cosine"`` or ``"euclidean"`` (:func:`prototype_predict`)."""
    _distance(distance)
    if not runs:
        raise DataError("no one-shot runs to score")
    errors = []
    for run in runs:
        emb = check_embeddings(embed(np.concatenate([run.train_images, run.test_images])),
                               f"embeddings of {run.name}").cpu().numpy()
        if len(emb) != 40:
            raise ShapeError(f"the embedder returned {len(emb)} rows for the 40 images of {run.name}")
        train, test = emb[:20], emb[20:]
        pred = prototype_predict(train, np.arange(20), test, distance)
        errors.append(100.0 * float((pred != run.answers).mean()))
    return {"error_percent": float(np.mean(errors)), "per_run_error_percent": errors, "runs": len(runs)}


def checkpoint_image_embedder(checkpoint: str | os.PathLike, device: str | torch.device = "cpu") -> Callable[[np.ndarray], np.ndarray]:
    """``images -> embeddings`` with a trained model and its config's evaluation transform
    (``device`` checked by :func:`dmlkit.embeddings.resolve_device`)."""
    device = resolve_device(device)
    model, config = load_checkpoint(Path(checkpoint), device=device)
    return model_image_embedder(model, config, device)


def model_image_embedder(model: torch.nn.Module, config: ExperimentConfig,
                         device: str | torch.device = "cpu") -> Callable[[np.ndarray], np.ndarray]:
    """``images -> embeddings`` with ``model`` (on ``device``, in eval mode, as
    :func:`dmlkit.training.load_checkpoint` returns it) and ``config``'s evaluation transform;
    for a caller that needs the checkpoint's config too (``dmlkit oneshot``: its data root)."""

    def embed(images: np.ndarray) -> np.ndarray:
        ds = ArrayDataset(images, np.zeros(len(images), dtype=np.int64), kind="image", invert=True)
        if config.data.transform is not None:
            ds = ds.with_transform(get_transforms(config.data.transform, train=False, image_size=config.data.image_size))
        emb, _ = embed_split(model, ds, config, device=device)
        return emb

    return embed
