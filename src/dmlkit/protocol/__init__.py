"""The fair benchmarking protocol of "A Metric Learning Reality Check" (Musgrave et al. 2020).

``dmlkit bench CONFIG.yaml`` = :class:`Bench`: class-disjoint split, cross-validated Bayesian
search per method (Optuna, SQLite/PostgreSQL storage, resumable, shared by workers), final
fold models over several seeds, separated/concatenated test accuracy with 95 % CIs, and the
results table. ``dmlkit compare`` = :func:`compare_results` (a t-test over training seeds and
test queries, :func:`seed_query_t_test`, Holm-corrected over the pairs).
"""

from __future__ import annotations

from dmlkit.protocol.compare import compare_results, relative_improvements, render_compare_markdown
from dmlkit.protocol.config import (
    BenchConfig,
    FixedSettings,
    MethodConfig,
    ProtocolConfig,
    SearchParam,
    bench_config_from_dict,
    load_bench_config,
)
from dmlkit.protocol.results import (
    build_results,
    format_cell,
    load_results,
    render_markdown,
    rich_table,
)
from dmlkit.protocol.runner import Bench, FinalStage, SearchStage, evaluate_runs, run_seed
from dmlkit.protocol.splits import (
    BenchSplit,
    Fold,
    TestClassGuard,
    TestSetLeakError,
    make_bench_split,
)
from dmlkit.protocol.stats import (
    mean_ci,
    paired_bootstrap,
    per_query_scores,
    seed_query_t_test,
)

__all__ = [
    "Bench",
    "BenchConfig",
    "BenchSplit",
    "FinalStage",
    "FixedSettings",
    "Fold",
    "MethodConfig",
    "ProtocolConfig",
    "SearchParam",
    "SearchStage",
    "TestClassGuard",
    "TestSetLeakError",
    "bench_config_from_dict",
    "build_results",
    "compare_results",
    "evaluate_runs",
    "format_cell",
    "load_bench_config",
    "load_results",
    "make_bench_split",
    "mean_ci",
    "paired_bootstrap",
    "per_query_scores",
    "relative_improvements",
    "render_compare_markdown",
    "render_markdown",
    "rich_table",
    "run_seed",
    "seed_query_t_test",
]
