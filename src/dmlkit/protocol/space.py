"""Search spaces: a method's declared hyperparameters -> Optuna suggestions.

Keys are ``loss.<param>``, ``miner.<param>`` or ``optimizer.loss_lr`` (validated by
:class:`dmlkit.protocol.config.MethodConfig`); each value is a :class:`SearchParam`.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Mapping
from typing import Any

from dmlkit.protocol.config import SearchParam

__all__ = ["distributions", "search_corners", "search_samples", "suggest"]


def suggest(trial: Any, space: Mapping[str, SearchParam]) -> dict[str, Any]:
    """Ask ``trial`` for every parameter of ``space`` (in a stable, sorted order)."""
    params: dict[str, Any] = {}
    for key in sorted(space):
        spec = space[key]
        if spec.type == "categorical":
            params[key] = trial.suggest_categorical(key, list(spec.choices or []))
        elif spec.type == "int":
            step = int(spec.step) if spec.step is not None else 1
            params[key] = trial.suggest_int(key, int(spec.low), int(spec.high), step=step, log=spec.log)
        else:
            params[key] = trial.suggest_float(key, float(spec.low), float(spec.high), step=spec.step, log=spec.log)
    return params


def distributions(space: Mapping[str, SearchParam]) -> dict[str, Any]:
    """The Optuna distributions of ``space`` (for fingerprints and reporting)."""
    import optuna

    out: dict[str, Any] = {}
    for key in sorted(space):
        spec = space[key]
        if spec.type == "categorical":
            out[key] = optuna.distributions.CategoricalDistribution(list(spec.choices or []))
        elif spec.type == "int":
            out[key] = optuna.distributions.IntDistribution(
                int(spec.low), int(spec.high), log=spec.log, step=int(spec.step or 1)
            )
        else:
            out[key] = optuna.distributions.FloatDistribution(
                float(spec.low), float(spec.high), log=spec.log, step=spec.step
            )
    return out


def search_corners(space: Mapping[str, SearchParam]) -> list[dict[str, Any]]:
    """Points of ``space`` that a config check builds the loss and miner with before any trial:
    every range at its low end, every range at its high end, and each categorical choice with
    the rest at their low ends (a parameter name or value the loss refuses then fails up front,
    not in every trial). A stepped range ends at its last grid point, as Optuna samples it."""
    if not space:
        return []
    grid = _sampled_distributions(space)
    low = {k: (spec.choices or [None])[0] if spec.type == "categorical" else spec.low for k, spec in space.items()}
    high = {k: (spec.choices or [None])[-1] if spec.type == "categorical" else grid[k].high
            for k, spec in space.items()}
    points = [low, high]
    for key, spec in space.items():
        if spec.type == "categorical":
            points += [{**low, key: choice} for choice in (spec.choices or [])[1:-1]]
    for point in points:
        for key, spec in space.items():
            if spec.type == "int":
                point[key] = int(point[key])
            elif spec.type == "float":
                point[key] = float(point[key])
    return points


def search_samples(space: Mapping[str, SearchParam], count: int = 32, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` points of ``space`` drawn from a fixed ``seed`` (so a check is reproducible):
    each range uniformly (log-uniformly when ``log``, on its grid when stepped), each choice
    uniformly, independently of the others, as Optuna's trials may sample them. The corners
    (:func:`search_corners`) miss a constraint that couples two searched parameters (a miner's
    ``cutoff < nonzero_loss_cutoff`` over overlapping ranges); these points find it with a
    probability that grows with the share of the space it refuses."""
    if not space:
        return []
    grid = _sampled_distributions(space)
    rng = random.Random(seed)
    return [{key: _sample(space[key], grid[key], rng) for key in sorted(space)} for _ in range(count)]


def _sampled_distributions(space: Mapping[str, SearchParam]) -> dict[str, Any]:
    """:func:`distributions`, whose stepped ranges end at their last grid point as Optuna
    samples them (1..10 step 4 samples 9, never 10, so a loss refusing 10 must not fail a
    check)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's "not divisible by step": the trials warn it
        return distributions(space)


def _sample(spec: SearchParam, dist: Any, rng: random.Random) -> Any:
    """One value of ``spec`` (its Optuna distribution ``dist``) drawn with ``rng``."""
    if spec.type == "categorical":
        return rng.choice(list(spec.choices or []))
    low, high = dist.low, dist.high
    if spec.log:
        value = math.exp(rng.uniform(math.log(low), math.log(high)))
    elif dist.step is not None:
        value = low + dist.step * rng.randint(0, round((high - low) / dist.step))
    else:
        value = rng.uniform(low, high)
    value = min(max(value, low), high)
    return int(round(value)) if spec.type == "int" else float(value)
