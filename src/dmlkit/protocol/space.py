"""Search spaces: a method's declared hyperparameters -> Optuna suggestions.

Keys are ``loss.<param>``, ``miner.<param>`` or ``optimizer.loss_lr`` (validated by
:class:`dmlkit.protocol.config.MethodConfig`); each value is a :class:`SearchParam`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from dmlkit.protocol.config import SearchParam

__all__ = ["distributions", "search_corners", "suggest"]


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
    # a stepped range's high end as Optuna samples it: the last point of the grid (1..10 step 4
    # samples 9, never 10, so a loss refusing 10 must not fail the check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's "not divisible by step": the trials warn it
        grid = distributions(space)
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
