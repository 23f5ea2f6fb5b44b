"""P@1 + R-Precision + MAP@R: dmlkit.metrics.evaluate vs pytorch-metric-learning's AccuracyCalculator.

Synthetic clustered embeddings (C class centres ~ N(0, I_d); each sample = its centre + sigma *
N(0, I_d), L2-normalised; sigma = 1.7 * (d / 128) ** 0.25 gives mid-range scores, MAP@R about
0.15-0.45), classes of equal size, labels shuffled. Every (case, side, repeat) runs in its own
subprocess so that the peak resident memory (``ru_maxrss``) of each side is measured alone;
both sides run in the same invocation, alternating, and the medians are compared. Each side
first evaluates 2,000 rows untimed (dmlkit: loads its compiled numba kernels, which are built
once per install and cached; both: warms the BLAS), then the timed call.

The peer runs as its authors recommend for these metrics: faiss kNN with
``k="max_bin_count"`` (k = largest class size - 1 with the query set as reference; its default
k = the whole reference set needs N^2 memory) and ``ref_includes_query=True`` via
``reference=None``. Its kNN index is ``IndexFlatIP`` by default (``--peer-index ip``): inner
product = cosine similarity on these unit vectors, the distance dmlkit uses. With the peer's
default ``IndexFlatL2`` the float32 rounding of ``|x|^2 + |y|^2 - 2<x, y>`` reorders a few
near-ties (R-Precision off by one neighbour, 1e-6 at N = 10k). Both sides use 2 threads.

    python benchmarks/bench_metrics.py                      # small grid: N=10k, d=128
    python benchmarks/bench_metrics.py --n 100000 --d 128 --classes n/50 100 --repeats 3
    python benchmarks/bench_metrics.py --full               # N in {10k,50k,100k} x d in {128,512}

Two more suites (``--suite``), same protocol (subprocess per side, alternating, medians):

* ``map`` - full-ranking MAP (``evaluate -m map``) against the peer's ``mean_average_precision``
  and, as third and fourth sides, dmlkit's own MAP@R path on the same data (``dmlkit-r``) and
  that path with float32 tiles only (``dmlkit-r32``: bfloat16 products turned off, the precision
  ``map`` must use; it separates the cost of the product's precision from the cost of counting).
  It also prints the fraction of pairs a full ranking must place among a query's positives (the
  negatives at or above its lowest positive, over 500 queries; MAP@R's selection keeps only its
  R nearest). The peer's
  default ``k="max_bin_count"`` sums precision over the relevant items among the first max-R
  neighbours and divides by R: with equal class sizes that is MAP@R, a truncated AP (a
  different and cheaper number: no value check); ``--peer-map-k all`` makes it rank the whole
  reference set (the same definition as dmlkit's ``map``; N^2 memory, small N only), and then
  the values are checked. The suite also prints this machine's float32 ``torch.mm`` rate and
  the time the symmetric N x N x d product alone would take at that rate.
* ``clustering`` - NMI + AMI: dmlkit's mean over 3 seeded k-means restarts (k-means++ seeds,
  exact bfloat16-screened assignments) against the peer's one faiss k-means (``niter=20``) and
  scikit-learn's NMI/AMI. Different k-means runs give different clusterings: the values are
  printed with dmlkit's spread over its restarts, not checked.

    python benchmarks/bench_metrics.py --suite map --n 50000 --classes n/50 --repeats 3
    python benchmarks/bench_metrics.py --suite clustering --n 100000 --classes 2000 --repeats 1

``--device cuda`` runs both sides on a GPU: dmlkit's torch path, the peer's own torch kNN
(``CustomKNN``, cosine, batches of 4,096 queries); it adds each side's peak GPU memory.

    python benchmarks/bench_metrics.py --device cuda --n 100000 --classes n/50 --repeats 3

Prints one row per case (medians over repeats; wall-clock seconds and, less sensitive to a busy
machine, the process's CPU seconds) and writes JSON with every measurement
(``--out``). Exit status 1 if any checked metric differs by more than ``--tol`` (default 1e-6).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SUITES = {
    # suite: {dmlkit metric: the peer's AccuracyCalculator key}
    "retrieval": {"precision_at_1": "precision_at_1", "r_precision": "r_precision",
                  "map_at_r": "mean_average_precision_at_r"},
    "map": {"map": "mean_average_precision"},
    "clustering": {"nmi": "NMI", "ami": "AMI"},
}
#: The sides a case runs (``--sides``): dmlkit, its MAP@R path with and without bfloat16 tiles
#: (map suite), the peer.
SIDES = ("dmlkit", "dmlkit-r", "dmlkit-r32", "peer")
METRICS = tuple(SUITES["retrieval"])
PEER_KEYS = SUITES["retrieval"]


def make_data(n: int, d: int, classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Clustered unit vectors with ``classes`` equal-size classes (labels shuffled)."""
    rng = np.random.default_rng(seed)
    sigma = 1.7 * (d / 128) ** 0.25
    centers = rng.standard_normal((classes, d), dtype=np.float32)
    labels = np.arange(n) % classes
    rng.shuffle(labels)
    x = centers[labels] + np.float32(sigma) * rng.standard_normal((n, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), labels.astype(np.int64)


# -- workers (run in a fresh subprocess each) --------------------------------------------------------
def _worker(side: str, data: str, threads: int, peer_index: str = "ip", suite: str = "retrieval",
            peer_map_k: str = "max_bin_count", device: str = "cpu", budget_mb: int = 256) -> None:
    import resource

    import torch

    torch.set_num_threads(threads)
    arrays = np.load(data)
    dev = torch.device(device)
    x, y = torch.from_numpy(arrays["x"]).to(dev), torch.from_numpy(arrays["y"]).to(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    keys = SUITES[suite]
    if side in ("dmlkit-r", "dmlkit-r32"):  # dmlkit's MAP@R path on the same data (map suite)
        keys = {"map_at_r": "map_at_r"}
    if side == "dmlkit-r32":  # float32 tiles only: what the kNN costs at map's product precision
        import dmlkit.metrics.knn

        dmlkit.metrics.knn._bf16_is_faster = lambda d: False
    if side in ("dmlkit", "dmlkit-r", "dmlkit-r32"):
        from dmlkit.metrics import evaluate

        evaluate(x[:3000], y[:3000], metrics=list(keys))  # warm-up: loads the compiled kernels
        t0, c0 = time.perf_counter(), time.process_time()
        res = evaluate(x, y, metrics=list(keys), memory_budget=budget_mb * 2**20)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        values = {m: float(res[m]) for m in keys}
        values.update({f"{m}_std": float(res[f"{m}_std"]) for m in keys if f"{m}_std" in res})
    else:
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

        k = None if suite == "map" and peer_map_k == "all" else "max_bin_count"
        calc = AccuracyCalculator(include=tuple(keys.values()), k=k, device=dev,
                                  knn_func=_peer_knn(dev, peer_index, threads))
        calc.get_accuracy(x[:3000], y[:3000])  # warm-up, as on the dmlkit side
        t0, c0 = time.perf_counter(), time.process_time()
        res = calc.get_accuracy(x, y)  # reference=None: ref_includes_query=True
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        values = {m: float(res[k]) for m, k in keys.items()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    gpu_peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    print(json.dumps({"side": side, "time_s": elapsed, "cpu_s": cpu, "peak_bytes": peak,
                      "gpu_peak_bytes": gpu_peak, "metrics": values}))


def _peer_knn(dev, peer_index: str, threads: int):
    """The peer's kNN: faiss on the CPU (``IndexFlatIP`` or ``IndexFlatL2``); on a GPU its torch
    kNN (``CustomKNN``: cosine similarity and ``topk`` in batches of 4,096 queries on the device),
    since faiss's GPU build is not on PyPI for every CUDA version."""
    if dev.type == "cuda":
        from pytorch_metric_learning.distances import CosineSimilarity, LpDistance
        from pytorch_metric_learning.utils.inference import CustomKNN

        return CustomKNN(CosineSimilarity() if peer_index == "ip" else LpDistance(), batch_size=4096)
    import faiss
    from pytorch_metric_learning.utils.inference import FaissKNN

    faiss.omp_set_num_threads(threads)
    return FaissKNN(index_init_fn=faiss.IndexFlatIP if peer_index == "ip" else faiss.IndexFlatL2)


def placed_fraction(x: np.ndarray, y: np.ndarray, queries: int = 500) -> float:
    """The fraction of (query, reference) pairs a full ranking places among the query's positives:
    the negatives whose closeness (inner product; the rows are unit vectors) is at or above the
    query's lowest positive, over the first ``queries`` rows as self-search queries."""
    q, placed = min(queries, x.shape[0]), 0
    s = x[:q].astype(np.float64) @ x.astype(np.float64).T
    for i in range(q):
        same = y == y[i]
        same[i] = False
        if same.any():
            negative = y != y[i]
            placed += int((s[i][negative] >= s[i][same].min()).sum())
    return placed / (q * x.shape[0])


def matmul_rate(d: int, tile: int = 1024) -> float:
    """GFLOP/s of a float32 ``(tile, d) x (d, tile)`` ``torch.mm`` on one thread, per CPU second
    (best of 6; the tiles of dmlkit's kernels run one single-threaded product per worker thread;
    CPU time, so that a busy machine's waiting is not counted)."""
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(tile, d, generator=gen), torch.randn(tile, d, generator=gen)
    out = torch.empty(tile, tile)
    best = math.inf
    for _ in range(6):
        t0 = time.thread_time()
        for _ in range(10):
            torch.mm(a, b.T, out=out)
        best = min(best, (time.thread_time() - t0) / 10)
    return 2 * tile * tile * d / best / 1e9


def _run_side(side: str, data: Path, threads: int, timeout: int, peer_index: str, suite: str = "retrieval",
              peer_map_k: str = "max_bin_count", device: str = "cpu", budget_mb: int = 256) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--data", str(data), "--threads", str(threads),
           "--peer-index", peer_index, "--suite", suite, "--peer-map-k", peer_map_k, "--device", device,
           "--memory-budget-mb", str(budget_mb)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _classes(spec: str, n: int) -> int:
    return max(2, n // int(spec.split("/")[1])) if spec.startswith("n/") else int(spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[10_000])
    p.add_argument("--d", type=int, nargs="+", default=[128])
    p.add_argument("--classes", nargs="+", default=["n/50", "100"],
                   help="class counts: an integer or n/<size> (classes of that size)")
    p.add_argument("--full", action="store_true", help="N in {10k, 50k, 100k}, d in {128, 512}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sides", nargs="+", default=None, choices=list(SIDES),
                   help="default: dmlkit and peer (and dmlkit-r, dmlkit-r32: dmlkit's MAP@R with and "
                        "without bfloat16 tiles, for --suite map)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("--peer-index", choices=["ip", "l2"], default="ip",
                   help="the peer's faiss index: inner product (= cosine here) or its default L2")
    p.add_argument("--suite", choices=sorted(SUITES), default="retrieval",
                   help="retrieval (P@1, RP, MAP@R), map (full-ranking MAP) or clustering (NMI, AMI)")
    p.add_argument("--peer-map-k", choices=["max_bin_count", "all"], default="max_bin_count",
                   help="the peer's k for --suite map: its default (truncated AP) or the whole ranking")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where both sides compute (cuda: the peer's torch kNN, GPU memory reported)")
    p.add_argument("--memory-budget-mb", type=int, default=256,
                   help="dmlkit's working-memory budget (evaluate's memory_budget; default 256 MiB)")
    p.add_argument("--out", type=Path, default=None, help="write all measurements as JSON")
    p.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.data, args.threads, args.peer_index, args.suite, args.peer_map_k,
                args.device, args.memory_budget_mb)
        return 0
    if args.full:
        args.n, args.d = [10_000, 50_000, 100_000], [128, 512]
    if args.sides is None:
        args.sides = list(SIDES) if args.suite == "map" else ["dmlkit", "peer"]
    rows, failed = [], False
    metrics = tuple(SUITES[args.suite])
    checked = args.suite == "retrieval" or (args.suite == "map" and args.peer_map_k == "all")
    header = (f"{'N':>7} {'d':>4} {'C':>5} | {'dmlkit s':>9} {'peer s':>9} {'time x':>7} | "
              f"{'dmlkit GB':>9} {'peer GB':>8} {'mem x':>6} | {'max |diff|':>10}  "
              + " / ".join(SUITES[args.suite]))
    print(f"suite {args.suite}; device {args.device}; {args.repeats} repeat(s), medians; {args.threads} threads; "
          f"peer index {args.peer_index}; dmlkit budget {args.memory_budget_mb} MiB; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}; load average {os.getloadavg()[0]:.1f}")
    print(header)
    rate = matmul_rate(args.d[0]) if args.suite == "map" and args.device == "cpu" else None
    if rate is not None:
        print(f"float32 torch.mm, 1024 x {args.d[0]} by {args.d[0]} x 1024: {rate:.0f} GFLOP/s per "
              "CPU second (one thread)")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.n:
            for d in args.d:
                for spec in args.classes:
                    c = _classes(spec, n)
                    data = Path(tmp) / f"data_{n}_{d}_{c}.npz"
                    x, y = make_data(n, d, c)
                    np.savez(data, x=x, y=y)
                    placed = placed_fraction(x, y) if args.suite == "map" else None
                    del x, y
                    runs: dict[str, list[dict]] = {s: [] for s in args.sides}
                    for rep in range(args.repeats):
                        order = args.sides if rep % 2 == 0 else args.sides[::-1]
                        for side in order:
                            runs[side].append(_run_side(side, data, args.threads, args.timeout,
                                                       args.peer_index, args.suite, args.peer_map_k,
                                                       args.device, args.memory_budget_mb))
                    row = {"n": n, "d": d, "classes": c, "runs": runs}
                    med = {s: {"time_s": statistics.median(r["time_s"] for r in rs),
                               "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                               "peak_bytes": statistics.median(r["peak_bytes"] for r in rs),
                               "gpu_peak_bytes": statistics.median(r["gpu_peak_bytes"] for r in rs),
                               "metrics": rs[0]["metrics"]} for s, rs in runs.items()}
                    row["median"] = med
                    line = f"{n:>7} {d:>4} {c:>5} | "
                    if "dmlkit" in med and "peer" in med:
                        a, b = med["dmlkit"], med["peer"]
                        diff = max(abs(a["metrics"][m] - b["metrics"][m]) for m in metrics)
                        row["max_abs_diff"] = diff
                        failed |= checked and diff > args.tol
                        line += (f"{a['time_s']:>9.2f} {b['time_s']:>9.2f} {a['time_s'] / b['time_s']:>7.2f} | "
                                 f"{a['peak_bytes'] / 1e9:>9.2f} {b['peak_bytes'] / 1e9:>8.2f} "
                                 f"{a['peak_bytes'] / b['peak_bytes']:>6.2f} | {diff:>10.1e}  ")
                    else:
                        s = next(iter(med))
                        line += f"{s}: {med[s]['time_s']:.2f} s, {med[s]['peak_bytes'] / 1e9:.2f} GB | "
                    for side, res in med.items():
                        m = res["metrics"]
                        line += f" {side}: " + " / ".join(
                            f"{100 * m[k]:.2f}" + (f" ± {100 * m[k + '_std']:.2f}" if k + "_std" in m else "")
                            for k in m if not k.endswith("_std"))
                    print(line, flush=True)
                    print("    CPU s: " + ", ".join(f"{side} {res['cpu_s']:.2f}" for side, res in med.items()))
                    if args.device == "cuda":
                        print("    wall s: " + ", ".join(f"{side} {res['time_s']:.3f}" for side, res in med.items())
                              + "; peak GPU GB: " + ", ".join(f"{side} {res['gpu_peak_bytes'] / 1e9:.2f}"
                                                              for side, res in med.items()), flush=True)
                    if "dmlkit" in med and "dmlkit-r" in med:
                        a, r_ = med["dmlkit"], med["dmlkit-r"]
                        print(f"    map / MAP@R (dmlkit): wall {a['time_s'] / r_['time_s']:.2f}x, "
                              f"CPU {a['cpu_s'] / r_['cpu_s']:.2f}x", flush=True)
                    if "dmlkit" in med and "dmlkit-r32" in med:
                        a, r_ = med["dmlkit"], med["dmlkit-r32"]
                        print(f"    map / MAP@R with float32 tiles: wall {a['time_s'] / r_['time_s']:.2f}x, "
                              f"CPU {a['cpu_s'] / r_['cpu_s']:.2f}x", flush=True)
                    if placed is not None:
                        row["placed_fraction"] = placed
                        print(f"    pairs placed among the positives (at or above a query's lowest): "
                              f"{100 * placed:.1f} %", flush=True)
                    if rate is not None:
                        flop = n * (n + 1) / 2 * 2 * d  # the symmetric product: one triangle
                        row["matmul_floor_cpu_s"] = flop / (rate * 1e9)
                        print(f"    the symmetric N x N x d product alone at {rate:.0f} GFLOP/s: "
                              f"{row['matmul_floor_cpu_s']:.2f} CPU s", flush=True)
                    rows.append(row)
                    data.unlink()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    if not checked:
        print("values not checked: the peer computes a different quantity (truncated AP or its own "
              "k-means run)")
    if failed:
        print(f"FAIL: a metric differs by more than {args.tol}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
