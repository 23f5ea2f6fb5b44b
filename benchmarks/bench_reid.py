"""Re-id evaluation speed and peak memory: dmlkit vs torchreid's rank evaluation.

    python benchmarks/bench_reid.py                       # Market and MSMT17 sizes, d = 2048 and 512
    python benchmarks/bench_reid.py --sizes market --dims 512 --json out.json

Data: synthetic features with the sizes of the real test sets (Market-1501: 3,368 queries x
15,913 gallery, 751 identities, 6 cameras; MSMT17: 11,659 x 82,161, 3,060 identities, 15
cameras); each feature is its identity's centre plus Gaussian noise, so the metrics are in a
realistic range (mAP ~ 0.3-0.6) and both implementations must agree on them.

Peer: ``torchreid.metrics.evaluate_rank`` (PyPI ``torchreid`` 0.2.5 = deep-person-reid 1.4.0,
the ``bench`` extra) with its ``compute_distance_matrix``. The PyPI package ships no compiled
Cython ranker, so its NumPy path runs (what a pip user gets); ``import torchreid`` needs
OpenCV and more, so the two metric modules are loaded from their files. torchreid sorts the
whole ``Q x G`` matrix (plus ``Q x G`` int64 indices and matches): at MSMT17 size that is over
20 GB, so the peer runs on the first ``--peer-queries`` queries there and dmlkit is timed on the
same subset for the ratio (and on all queries alone).

Each measurement runs in a fresh process; peak memory is the growth of the resident set
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``) over the data already loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SIZES = {
    "market": {"queries": 3368, "gallery": 15913, "ids": 751, "cams": 6},
    "msmt17": {"queries": 11659, "gallery": 82161, "ids": 3060, "cams": 15},
}


def make_data(size: str, dim: int, seed: int = 0):
    s = SIZES[size]
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((s["ids"], dim), dtype=np.float32)
    g_ids = np.concatenate([np.arange(s["ids"]), rng.integers(0, s["ids"], s["gallery"] - s["ids"])])
    q_ids = rng.integers(0, s["ids"], s["queries"])
    noise = np.float32(2.4 * (dim / 512) ** 0.27)  # mAP in the 0.3-0.7 range at both dims
    g = centres[g_ids] + noise * rng.standard_normal((g_ids.size, dim), dtype=np.float32)
    q = centres[q_ids] + noise * rng.standard_normal((q_ids.size, dim), dtype=np.float32)
    return q, g, q_ids, g_ids, rng.integers(0, s["cams"], q_ids.size), rng.integers(0, s["cams"], g_ids.size)


def _load_file(name: str, rel: str):
    spec = importlib.util.find_spec("torchreid")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torchreid is not installed: pip install 'dmlkit[bench]'")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    mod_spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def worker(method: str, size: str, dim: int, n_queries: int | None) -> dict:
    import warnings

    import torch

    q, g, q_ids, g_ids, q_cams, g_cams = make_data(size, dim)
    if n_queries:
        q, q_ids, q_cams = q[:n_queries], q_ids[:n_queries], q_cams[:n_queries]
    if method == "torchreid":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rank = _load_file("torchreid_rank", "reid/metrics/rank.py")
        dist = _load_file("torchreid_distance", "reid/metrics/distance.py")
    else:
        from dmlkit.apps.reid import evaluate_reid

        evaluate_reid(q[:8], g[:64], q_ids[:8], g_ids[:64], q_cams[:8], g_cams[:64])  # compile
    base = _rss("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    t0 = time.perf_counter()
    if method == "torchreid":
        distmat = dist.compute_distance_matrix(torch.from_numpy(q), torch.from_numpy(g)).numpy()
        t_dist = time.perf_counter() - t0
        cmc, mean_ap = rank.evaluate_rank(distmat, q_ids, g_ids, q_cams, g_cams, max_rank=50)
        out = {"rank_1": float(cmc[0]), "rank_5": float(cmc[4]), "map": float(mean_ap),
               "cmc50": [float(c) for c in cmc], "distance_seconds": t_dist}
    else:
        rerank = method == "dmlkit_rerank"
        r = evaluate_reid(q, g, q_ids, g_ids, q_cams, g_cams, rerank=rerank)
        out = {"rank_1": r.rank(1), "rank_5": r.rank(5), "map": r.mAP, "minp": r.mINP,
               "cmc50": r.cmc[:50].tolist()}
    out["seconds"] = time.perf_counter() - t0
    out["peak_mb"] = max(0, _rss("VmHWM") - base) / 2**20
    if method == "dmlkit" and n_queries is not None:
        # the protocol alone, on torchreid's own distance matrix (after the measurement above):
        # identical inputs must give identical numbers; also times the ranking step alone
        from dmlkit.apps.reid import evaluate_reid_scores

        dist = _load_file("torchreid_distance", "reid/metrics/distance.py")
        distmat = dist.compute_distance_matrix(torch.from_numpy(q), torch.from_numpy(g)).numpy()
        t1 = time.perf_counter()
        r = evaluate_reid_scores(distmat, q_ids, g_ids, q_cams, g_cams)
        out["rank_only_seconds"] = time.perf_counter() - t1
        out["same_distmat"] = {"map": r.mAP, "cmc50": r.cmc[:50].tolist()}
    out["threads"] = torch.get_num_threads()
    return out


def run(method: str, size: str, dim: int, n_queries: int | None) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, "--sizes", size, "--dims", str(dim)]
    cmd += ["--queries", str(n_queries or 0)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{method} {size} d={dim} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="market,msmt17")
    ap.add_argument("--dims", default="2048,512")
    ap.add_argument("--peer-queries", type=int, default=1000,
                    help="queries given to the peer at MSMT17 size (its memory grows with Q x G)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--queries", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    ap.add_argument("--rerank", action="store_true",
                    help="only time k-reciprocal re-ranking (k1 20, k2 6, lambda 0.3) vs plain")
    args = ap.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    sizes = args.sizes.split(",")
    if args.worker:
        print(json.dumps(worker(args.worker, sizes[0], dims[0], args.queries or None)))
        return
    rows = []
    if args.rerank:
        for size in sizes:
            for dim in dims:
                plain = run("dmlkit", size, dim, None)
                rr = run("dmlkit_rerank", size, dim, None)
                rows.append({"size": size, "dim": dim, "plain": plain, "rerank": rr})
                print(f"{size:7s} d={dim:5d} plain {plain['seconds']:.2f} s {plain['peak_mb']:.0f} MB "
                      f"mAP {plain['map']:.4f} mINP {plain['minp']:.4f} R1 {plain['rank_1']:.4f} | "
                      f"re-ranked {rr['seconds']:.2f} s {rr['peak_mb']:.0f} MB mAP {rr['map']:.4f} "
                      f"mINP {rr['minp']:.4f} R1 {rr['rank_1']:.4f}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return
    for size in sizes:
        for dim in dims:
            n_peer = None if size == "market" else args.peer_queries
            ours = run("dmlkit", size, dim, n_peer or SIZES[size]["queries"])
            peer = run("torchreid", size, dim, n_peer or SIZES[size]["queries"])
            sd = ours["same_distmat"]  # torchreid's argsort breaks exact float32 ties arbitrarily
            same = {"map": abs(sd["map"] - peer["map"]),
                    "cmc50": float(np.max(np.abs(np.subtract(sd["cmc50"], peer["cmc50"]))))}
            peer_rank = peer["seconds"] - peer["distance_seconds"]
            row = {"size": size, "dim": dim, "queries": n_peer or SIZES[size]["queries"],
                   "gallery": SIZES[size]["gallery"], "dmlkit": ours, "torchreid": peer,
                   "difference_on_one_distance_matrix": same,
                   "time_ratio": ours["seconds"] / peer["seconds"],
                   "memory_ratio": ours["peak_mb"] / max(peer["peak_mb"], 1e-9),
                   "rank_only_ratio": ours["rank_only_seconds"] / peer_rank}
            if n_peer:
                row["dmlkit_all_queries"] = run("dmlkit", size, dim, None)
            rows.append(row)
            print(f"{size:7s} d={dim:5d} Q={row['queries']:6d} G={row['gallery']:6d} | dmlkit "
                  f"{ours['seconds']:7.2f} s {ours['peak_mb']:8.0f} MB | torchreid "
                  f"{peer['seconds']:7.2f} s (distances {peer['distance_seconds']:.2f} s) "
                  f"{peer['peak_mb']:8.0f} MB | time x{row['time_ratio']:.2f} memory "
                  f"x{row['memory_ratio']:.3f} | R1 {ours['rank_1']:.4f}/{peer['rank_1']:.4f} "
                  f"mAP {ours['map']:.4f}/{peer['map']:.4f} | ranking only: "
                  f"{ours['rank_only_seconds']:.2f} s vs {peer_rank:.2f} s "
                  f"(x{row['rank_only_ratio']:.3f}) | on one distance matrix |d mAP| "
                  f"{same['map']:.1e}, max |d CMC| {same['cmc50']:.1e}",
                  flush=True)
            if n_peer:
                full = row["dmlkit_all_queries"]
                print(f"{'':7s} dmlkit on all {SIZES[size]['queries']} queries: "
                      f"{full['seconds']:.2f} s, {full['peak_mb']:.0f} MB, R1 {full['rank_1']:.4f} "
                      f"mAP {full['map']:.4f} mINP {full['minp']:.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
