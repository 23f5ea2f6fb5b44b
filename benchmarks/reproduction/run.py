"""Driver of the "A Metric Learning Reality Check" reproduction (issue 17), one command per dataset.

Everything goes through dmlkit's own commands: ``dmlkit bench`` (search + final runs, resumable
through the study's SQLite file), ``dmlkit compare`` (t-test over seeds and queries) and
``dmlkit report`` (HTML). The driver only orders the work so that a run cut short still leaves
complete, usable results:

* ``study NAME``: for each method in turn (contrastive and triplet first, the references of the
  comparison), ``dmlkit bench CONFIG -o OUT -m METHOD`` = its cross-validated search and its final
  runs; then ``collect``. Rerunning continues where it stopped (finished trials and final runs
  are reused).
* ``collect NAME``: the results table of every method whose final runs are all present
  (``dmlkit bench --stage final`` on those; nothing is retrained), copied small into
  ``benchmarks/reproduction/results/NAME.json``/``.md``; the paired comparison against contrastive
  and triplet (``dmlkit compare``) and the relative-improvement figure.
* ``report NAME``: ``dmlkit report OUT -o OUT/report.html`` (copied to
  ``benchmarks/reproduction/reports/NAME.html`` when under 2 MiB).

NAME is ``omniglot`` or ``alphadigits`` (``benchmarks/reproduction/NAME.yaml``).

    python benchmarks/reproduction/run.py study omniglot --data-root ../shared/data --workers 2
    python benchmarks/reproduction/run.py study alphadigits --data-root ../shared/data
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STUDIES = ("omniglot", "alphadigits")
#: The references of the comparison run first, so that a partial study can still be compared.
FIRST = ("contrastive", "triplet")


def config_path(name: str) -> Path:
    if name not in STUDIES:
        raise SystemExit(f"unknown study {name!r}: choose one of {', '.join(STUDIES)}")
    return HERE / f"{name}.yaml"


def study_config(name: str) -> dict:
    return yaml.safe_load(config_path(name).read_text())


def method_order(config: dict) -> list[str]:
    names = [m["name"] for m in config["methods"]]
    return [n for n in FIRST if n in names] + [n for n in names if n not in FIRST]


def final_complete(out: Path, method: str, config: dict) -> bool:
    """All final runs of ``method`` (every seed x fold) have test embeddings and metrics."""
    seeds = config["protocol"].get("seeds") or [0]
    folds = int(config["protocol"].get("folds") or 4)
    for seed in seeds:
        for fold in range(folds):
            run = out / "final" / method / f"seed{seed}" / f"fold{fold}"
            if not ((run / "embeddings" / "test.npz").exists() and (run / "metrics.json").exists()):
                return False
    return True


def dmlkit(*args: str, log: Path | None = None) -> int:
    """Run ``python -m dmlkit ARGS`` (the same interpreter), echoing the command."""
    cmd = [sys.executable, "-m", "dmlkit", *args]
    print("$ dmlkit " + " ".join(args), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=REPO)
    print(f"  -> exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
    return rc


def bench_args(name: str, out: Path, data_root: str | None, threads: int) -> list[str]:
    args = [str(config_path(name).relative_to(REPO)), "-o", str(out), "--threads", str(threads), "--quiet"]
    if data_root:
        args += ["--data-root", data_root]
    return args


def cmd_study(a: argparse.Namespace) -> int:
    config = study_config(a.name)
    out = Path(a.out or REPO / "runs" / "reproduction" / a.name)
    methods = a.method or method_order(config)
    t0 = time.perf_counter()
    for method in methods:
        if final_complete(out, method, config):
            print(f"{method}: done (search and final runs present)", flush=True)
            continue
        rc = dmlkit("bench", *bench_args(a.name, out, a.data_root, a.threads), "-m", method,
                    "--workers", str(a.workers))
        if rc == 2:  # a user error (config, data): every other method would fail the same way
            print(f"{method}: dmlkit bench refused (exit 2, message above); stopping", flush=True)
            return rc
        if rc != 0:
            print(f"{method}: dmlkit bench failed (exit {rc}); continuing with the next method", flush=True)
        print(f"[{time.perf_counter() - t0:.0f} s] {method} finished", flush=True)
    a.out = str(out)
    return cmd_collect(a)


def cmd_collect(a: argparse.Namespace) -> int:
    config = study_config(a.name)
    out = Path(a.out or REPO / "runs" / "reproduction" / a.name)
    done = [m for m in method_order(config) if final_complete(out, m, config)]
    if not done:
        print(f"no method of {a.name} has all its final runs in {out} yet", flush=True)
        return 1
    method_args = [x for m in done for x in ("-m", m)]
    rc = dmlkit("bench", *bench_args(a.name, out, a.data_root, a.threads), "--stage", "final", *method_args)
    if rc != 0:
        return rc
    results_dir = HERE / "results"
    results_dir.mkdir(exist_ok=True)
    shutil.copyfile(out / "results.json", results_dir / f"{a.name}.json")
    shutil.copyfile(out / "results.md", results_dir / f"{a.name}.md")
    for ref in FIRST:
        if ref in done and len(done) > 1:
            for suffix in ("json", "md"):
                dmlkit("compare", str(out), "--baseline", ref,
                       "-o", str(results_dir / f"{a.name}_vs_{ref}.{suffix}"))
    summary = compact_comparison(results_dir, a.name)
    if summary:
        (results_dir / f"{a.name}_compare_map.md").write_text(summary)
    try:
        from figures import relative_improvement_figure  # the sibling module

        relative_improvement_figure(results_dir / f"{a.name}.json", HERE / "figures" / f"{a.name}_relative.png",
                                    title=a.name)
    except ImportError as exc:  # matplotlib missing: the table is still written
        print(f"no figure: {exc}", flush=True)
    print(json.dumps({"methods": done, "results": str(results_dir / f"{a.name}.json")}), flush=True)
    return 0


def compact_comparison(results_dir: Path, name: str, metric: str = "map_at_r") -> str:
    """One Markdown table of ``metric`` differences (points, 95 % CI, significant) against
    contrastive and triplet, both modes, from the ``dmlkit compare`` JSON files."""
    cells: dict[str, dict[str, str]] = {}
    columns = []
    for ref in FIRST:
        path = results_dir / f"{name}_vs_{ref}.json"
        if not path.exists():
            continue
        for c in json.loads(path.read_text())["comparisons"]:
            if c["metric"] != metric:
                continue
            col = f"vs {ref}, {c['mode'][:6]}."
            if col not in columns:
                columns.append(col)
            sig = {True: " *", False: "", None: " ?"}[c.get("significant")]
            cells.setdefault(c["a"], {})[col] = (
                f"{100 * c['diff']:+.2f} [{100 * c['ci_low']:+.2f}, {100 * c['ci_high']:+.2f}]{sig}")
    if not cells:
        return ""
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for method, row in cells.items():
        lines.append(f"| {method} | " + " | ".join(row.get(col, "-") for col in columns) + " |")
    return "\n".join(lines) + "\n"


def cmd_report(a: argparse.Namespace) -> int:
    """Render the study's HTML report into the bench directory (it writes figures/ beside it);
    the self-contained HTML is copied to ``benchmarks/reproduction/reports/`` when under 2 MiB."""
    out = Path(a.out or REPO / "runs" / "reproduction" / a.name)
    html = out / "report.html"
    args = ["report", str(out), "-o", str(html), "--quiet", "--maps", a.maps]
    if a.data_root:
        args += ["--data-root", a.data_root]
    rc = dmlkit(*args)
    if rc != 0:
        return rc
    size = os.path.getsize(html) / 2**20
    if size <= 2:
        target = HERE / "reports" / f"{a.name}.html"
        target.parent.mkdir(exist_ok=True)
        shutil.copyfile(html, target)
        print(f"{target}: {size:.2f} MiB", flush=True)
    else:
        print(f"{html}: {size:.2f} MiB, over 2 MiB: not copied beside the document", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command, help_text in (("study", "search + final runs of every method, then collect"),
                               ("collect", "results of the finished methods, compare, figure"),
                               ("report", "render the HTML report of the study")):
        p = sub.add_parser(command, help=help_text)
        p.add_argument("name", choices=STUDIES)
        p.add_argument("--out", help="bench directory (default runs/reproduction/NAME)")
        p.add_argument("--data-root", default=os.environ.get("DMLKIT_DATA"))
        p.add_argument("--threads", type=int, default=1, help="torch threads per process")
        p.add_argument("--workers", type=int, default=1, help="dmlkit bench --workers")
        p.add_argument("--method", "-m", action="append", help="only these methods (study)")
        p.add_argument("--maps", default="pca", help="dmlkit report --maps (umap/t-SNE are slow on a CPU)")
    a = parser.parse_args(argv)
    return {"study": cmd_study, "collect": cmd_collect, "report": cmd_report}[a.command](a)


if __name__ == "__main__":
    raise SystemExit(main())
