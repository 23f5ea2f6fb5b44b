"""How often ``dmlkit compare`` calls equal methods different, and how often its intervals and
``dmlkit fewshot``'s cover the truth (simulated; 5 % / 95 % nominal). docs/guide.md quotes it::

    python benchmarks/significance_sim.py [--reps 2000]

Per-query scores of a method (``S`` seeds x ``Q`` queries) = ``sd_seed`` x a seed offset +
the queries' shared difficulty (sd 0.1) + the method's own luck on each query
(``sd_method_query``) + noise (sd 0.05), all methods of equal quality. Regimes:
seed-dominated (3 seeds, sd_seed 0.02, luck 0.035), mixed (5 seeds, luck 0.2, the seed part
of the difference's variance twice the query part), query-dominated (3 or 5 seeds, sd_seed
0.0005, luck 0.2): the statistics audit's settings.
Few-shot: 5-way 1-shot over 3 and 5 episodes of Gaussian classes, truth from 20,000 episodes.
"""

from __future__ import annotations

import argparse
import itertools
import warnings

import numpy as np

from dmlkit.apps import few_shot_accuracy
from dmlkit.protocol.stats import holm_adjusted, seed_query_t_test


def equal_methods(rng: np.random.Generator, n: int, seeds: int, queries: int, sd_seed: float,
                  sd_method_query: float) -> list[np.ndarray]:
    """``n`` methods' ``(seeds, queries)`` scores, equal in expectation."""
    shared = rng.normal(0, 0.1, queries)
    return [sd_seed * rng.normal(size=(seeds, 1)) + shared + rng.normal(0, sd_method_query, queries)
            + 0.05 * rng.normal(size=(seeds, queries)) for _ in range(n)]


def rate(hits: int, reps: int) -> str:
    p = hits / reps
    return f"{100 * p:.1f} % ± {100 * np.sqrt(p * (1 - p) / reps):.1f}"


def compare_figures(reps: int) -> None:
    q = 300
    mixed = np.sqrt(2 * 5 * 0.2 ** 2 / q)  # 2 sd_seed^2 / S = 2 x (2 luck^2) / Q
    regimes = {"seed-dominated, 3 seeds": (3, 0.02, 0.035), "mixed, 5 seeds": (5, mixed, 0.2),
               "query-dominated, 3 seeds": (3, 0.0005, 0.2)}
    for name, (s, sd_seed, sd_v) in regimes.items():
        rng = np.random.default_rng(1)
        called = sum(bool(seed_query_t_test(*equal_methods(rng, 2, s, q, sd_seed, sd_v)).significant)
                     for _ in range(reps))
        print(f"compare, {name}: equal pair called significant {rate(called, reps)}; "
              f"95 % CI covers 0 {rate(reps - called, reps)}", flush=True)
    rng = np.random.default_rng(2)
    families = max(1, reps // 4)
    flagged = 0
    for _ in range(families):
        x = equal_methods(rng, 4, 5, q, 0.0005, 0.2)
        p = [seed_query_t_test(x[i], x[j]).p for i, j in itertools.combinations(range(4), 2)]
        flagged += bool((holm_adjusted(p) < 0.05).any())
    print(f"compare, query-dominated, 5 seeds: four equal methods (6 pairs, Holm) with a "
          f"significant pair {rate(flagged, families)}", flush=True)


def fewshot_figures(reps: int) -> None:
    rng = np.random.default_rng(0)
    x = (rng.normal(0, 0.9, (30, 1, 8)) + rng.normal(0, 1, (30, 20, 8))).reshape(-1, 8).astype(np.float32)
    y = np.repeat(np.arange(30), 20)
    truth = few_shot_accuracy(x, y, 5, 1, 5, episodes=20000, seed=12345)["accuracy"]
    for episodes in (3, 5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the zero-width warnings of a few draws
            runs = [few_shot_accuracy(x, y, 5, 1, 5, episodes=episodes, seed=r) for r in range(reps)]
        covered = sum(abs(r["accuracy"] - truth) <= r["ci95"] for r in runs)
        print(f"fewshot, {episodes} episodes: ci95 covers the accuracy {rate(covered, reps)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000, help="simulated comparisons per regime")
    parser.add_argument("--fewshot-reps", type=int, default=300, help="simulated few-shot runs")
    args = parser.parse_args()
    compare_figures(args.reps)
    if args.fewshot_reps > 0:
        fewshot_figures(args.fewshot_reps)


if __name__ == "__main__":
    main()
