"""Out-of-core exact evaluation: embeddings on disk as shards, streamed by dmlkit.metrics.streaming.

Synthetic clustered embeddings as in ``bench_metrics.py`` (C class centres ~ N(0, I_d), each
sample = its centre + sigma N(0, I_d), sigma = 1.7 (d/128)^(1/4), L2-normalised, equal class
sizes, labels shuffled) are generated chunk by chunk and written with
:class:`dmlkit.embedding_shards.ShardWriter` (never N x d in memory). Then, each in its own
subprocess so its peak resident memory (``ru_maxrss``) is its own:

* ``stream`` - :func:`dmlkit.metrics.streaming.evaluate_streaming` on the shard directory
  with ``--memory-mb`` as the budget (P@1, R-Precision, MAP@R, Recall@1/10);
* ``memory`` - :func:`dmlkit.metrics.evaluate` on the same values loaded in RAM;
* ``peer`` - pytorch-metric-learning's ``AccuracyCalculator`` (faiss ``IndexFlatIP``,
  ``k="max_bin_count"``) on the same values loaded in RAM (P@1, R-Precision, MAP@R).

Peak RSS is reported with its growth during the timed call (the process's peak after the
warm-up, with Python, torch, numba and, for the in-memory sides, the loaded data, is the
baseline). Every side evaluates the float32 values the shards decode to, so all numbers must agree
(dmlkit's two paths exactly, the peer to float32 near-ties). Sides run in the same invocation,
one after another.

    python benchmarks/bench_out_of_core.py --n 100000 --classes 2000 --sides stream memory peer
    nice -n 10 python benchmarks/bench_out_of_core.py --n 1000000 --classes 10000 --sides stream \\
        --memory-mb 512 --dtype float16 --workdir /tmp/ooc1m
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIDES = ("stream", "memory", "peer")
METRICS = ("precision_at_1", "recall_at_10", "r_precision", "map_at_r")
PEER_KEYS = {"precision_at_1": "precision_at_1", "r_precision": "r_precision",
             "map_at_r": "mean_average_precision_at_r"}


def write_data(directory: Path, n: int, d: int, classes: int, dtype: str, shard_rows: int,
               chunk: int = 65536, seed: int = 0) -> dict:
    """Generate the clustered set chunk by chunk straight into shards; returns timing."""
    from dmlkit.embedding_shards import ShardWriter

    rng = np.random.default_rng(seed)
    sigma = np.float32(1.7 * (d / 128) ** 0.25)
    centers = rng.standard_normal((classes, d), dtype=np.float32)
    labels = (np.arange(n) % classes).astype(np.int64)
    rng.shuffle(labels)
    t0 = time.perf_counter()
    with ShardWriter(directory, dtype=dtype, shard_rows=shard_rows, overwrite=True,
                     metadata={"synthetic": {"n": n, "d": d, "classes": classes, "seed": seed}}) as w:
        for i, a0 in enumerate(range(0, n, chunk)):
            a1 = min(n, a0 + chunk)
            g = np.random.default_rng([seed, i])
            x = centers[labels[a0:a1]] + sigma * g.standard_normal((a1 - a0, d), dtype=np.float32)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            w.append(x, labels[a0:a1])
    return {"write_s": time.perf_counter() - t0}


def _usage() -> tuple[int, float]:
    """``(peak RSS bytes so far, CPU seconds so far)`` of this process."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_maxrss * 1024, u.ru_utime + u.ru_stime


def _worker(side: str, shards_dir: str, threads: int, memory_mb: int, query_rows: int | None = None,
            progress: bool = False) -> None:
    import resource

    import torch

    torch.set_num_threads(threads)
    from dmlkit.embedding_shards import open_shards

    shards = open_shards(shards_dir)
    if side == "stream":
        from dmlkit.metrics import evaluate
        from dmlkit.metrics.streaming import evaluate_streaming

        evaluate(shards[:2000], shards.labels[:2000])  # warm-up: loads the compiled kernels
        base, cpu0 = _usage()
        t0 = time.perf_counter()
        res = evaluate_streaming(shards, metrics=["precision_at_1", "recall_at_10", "r_precision", "map_at_r"],
                                 memory_budget=memory_mb * 2**20, progress=progress,
                                 query_range=None if query_rows is None else (0, query_rows))
        elapsed = time.perf_counter() - t0
        values = {m: float(res[m]) for m in METRICS}
    elif side == "memory":
        from dmlkit.metrics import evaluate

        x, y = shards.to_numpy(), shards.labels
        evaluate(x[:2000], y[:2000])
        base, cpu0 = _usage()
        t0 = time.perf_counter()
        res = evaluate(x, y, metrics=["precision_at_1", "recall_at_10", "r_precision", "map_at_r"],
                       memory_budget=memory_mb * 2**20)
        elapsed = time.perf_counter() - t0
        values = {m: float(res[m]) for m in METRICS}
    else:
        import faiss
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
        from pytorch_metric_learning.utils.inference import FaissKNN

        faiss.omp_set_num_threads(threads)
        xt, yt = torch.from_numpy(shards.to_numpy()), torch.from_numpy(shards.labels)
        calc = AccuracyCalculator(include=tuple(PEER_KEYS.values()), k="max_bin_count",
                                  device=torch.device("cpu"),
                                  knn_func=FaissKNN(index_init_fn=faiss.IndexFlatIP))
        calc.get_accuracy(xt[:2000], yt[:2000])
        base, cpu0 = _usage()
        t0 = time.perf_counter()
        res = calc.get_accuracy(xt, yt)
        elapsed = time.perf_counter() - t0
        values = {m: float(res[k]) for m, k in PEER_KEYS.items()}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"side": side, "time_s": elapsed, "cpu_s": usage.ru_utime + usage.ru_stime - cpu0,
                      "peak_bytes": usage.ru_maxrss * 1024, "before_bytes": base, "metrics": values}))


def _run(side: str, shards_dir: Path, threads: int, memory_mb: int, timeout: int,
         query_rows: int | None = None, progress: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--shards", str(shards_dir),
           "--threads", str(threads), "--memory-mb", str(memory_mb)]
    if query_rows is not None:
        cmd += ["--query-rows", str(query_rows)]
    if progress:
        cmd += ["--progress"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:  # with progress, the worker's progress bar goes to this process's stderr
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE,
                             text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"side": side, "error": f"timed out after {timeout} s"}
    if out.returncode != 0:
        return {"side": side, "error": f"exit {out.returncode}: {(out.stderr or '').strip()[-500:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--classes", type=int, default=2000)
    p.add_argument("--dtype", choices=["float32", "float16"], default="float16")
    p.add_argument("--shard-rows", type=int, default=65536)
    p.add_argument("--memory-mb", type=int, default=512, help="budget of both dmlkit sides, MiB")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--query-rows", type=int, default=None,
                   help="stream side only: evaluate the first QUERY_ROWS queries against all N "
                        "(query_range); the full time is about N / QUERY_ROWS times longer")
    p.add_argument("--timeout", type=int, default=7200, help="seconds per side")
    p.add_argument("--workdir", type=Path, default=None, help="where the shards go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the shards (reused when present)")
    p.add_argument("--out", type=Path, default=None, help="write the measurements as JSON")
    p.add_argument("--progress", action="store_true", help="the stream side's progress bar on stderr")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.shards, args.threads, args.memory_mb, args.query_rows, args.progress)
        return 0
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dmlkit-ooc-"))
    shards_dir = work / f"shards_{args.n}_{args.d}_{args.classes}_{args.dtype}"
    print(f"N={args.n} d={args.d} C={args.classes} dtype={args.dtype} budget={args.memory_mb} MiB "
          f"threads={args.threads}; {time.strftime('%Y-%m-%d %H:%M:%S')}; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    result: dict = {"n": args.n, "d": args.d, "classes": args.classes, "dtype": args.dtype,
                    "memory_mb": args.memory_mb, "sides": {}}
    try:
        if not (shards_dir / "manifest.json").exists():
            result.update(write_data(shards_dir, args.n, args.d, args.classes, args.dtype, args.shard_rows))
            print(f"wrote {shards_dir} in {result['write_s']:.1f} s", flush=True)
        for side in args.sides:
            r = _run(side, shards_dir, args.threads, args.memory_mb, args.timeout,
                     args.query_rows if side == "stream" else None, args.progress and side == "stream")
            result["sides"][side] = r
            if "error" in r:
                print(f"{side:>7}: FAILED ({r['error']})", flush=True)
                continue
            vals = " ".join(f"{k}={v:.6f}" for k, v in r["metrics"].items())
            before = r.get("before_bytes")
            grew = "" if before is None else f" (+{(r['peak_bytes'] - before) / 2**20:.0f} during the timed call)"
            grew += "" if "cpu_s" not in r else f", CPU {r['cpu_s']:.1f} s"
            print(f"{side:>7}: {r['time_s']:9.1f} s  peak RSS {r['peak_bytes'] / 2**20:8.0f} MiB{grew}  {vals}",
                  flush=True)
            if side == "stream" and args.query_rows:
                r["full_time_estimate_s"] = r["time_s"] * args.n / args.query_rows
                print(f"         {args.query_rows} of {args.n} queries: all {args.n} would take about "
                      f"{r['full_time_estimate_s']:.0f} s (time ~ queries x references)", flush=True)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    ok = {s: r for s, r in result["sides"].items() if "error" not in r}
    if "stream" in ok and "memory" in ok and not args.query_rows:
        same = ok["stream"]["metrics"] == ok["memory"]["metrics"]
        result["stream_equals_memory"] = same
        print(f"stream == memory (every metric, exactly): {same}; time ratio stream/memory "
              f"{ok['stream']['time_s'] / ok['memory']['time_s']:.2f}, peak RSS ratio "
              f"{ok['stream']['peak_bytes'] / ok['memory']['peak_bytes']:.2f}")
    if "stream" in ok and "peer" in ok and not args.query_rows:
        diff = max(abs(ok["stream"]["metrics"][m] - ok["peer"]["metrics"][m]) for m in PEER_KEYS)
        result["max_abs_diff_peer"] = diff
        print(f"stream vs peer: max |diff| {diff:.1e}; time ratio {ok['stream']['time_s'] / ok['peer']['time_s']:.2f}, "
              f"peak RSS ratio {ok['stream']['peak_bytes'] / ok['peer']['peak_bytes']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if result.get("stream_equals_memory", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
