"""Speed of patch networks: descriptors/s, pair scores/s and all-pairs matching cost (n x m).

A 2-channel (decision) network must run once per pair: matching n patches against m costs
n * m network passes. A descriptor network runs n + m branch passes and then n * m cheap
distances; a siamese network with a decision head runs n + m branch passes and n * m passes of
its small fully connected head. This script measures the per-item costs side by side in one
process and the wall time of full n x m matching for growing n = m, and prints where each
approach wins.

    python benchmarks/bench_patches.py                      # CPU, the trained configuration
    python benchmarks/bench_patches.py --width 1 --size 64  # the paper's full-size networks
    python benchmarks/bench_patches.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dmlkit.apps.patches import build_patch_model, score_matrix
from dmlkit.models import to_device


def _timeit(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def per_item(names: list[str], size: int, width: float, batch: int, repeats: int, device: str) -> dict:
    x = torch.randn(batch, 1, size, size, device=device)
    y = torch.randn(batch, 1, size, size, device=device)
    out = {}
    for name in names:
        m = to_device(build_patch_model(name, size, width), device).eval()  # as dmlkit patches places it
        rec = {"pairs_per_s": batch / _timeit(lambda m=m: m.score(x, y), repeats)}
        if m.has_descriptor:
            rec["descriptors_per_s"] = batch / _timeit(lambda m=m: m.describe(x), repeats)
            dx, dy = m.describe(x), m.describe(y)
            rec["pairs_from_descriptors_per_s"] = batch / _timeit(lambda m=m, dx=dx, dy=dy: m.decide(dx, dy), repeats)
        out[name] = rec
    return out


def match_all(name: str, n: int, size: int, width: float, device: str) -> float:
    """Seconds to score every pair of n x n patches with ``score_matrix`` (n * m network passes
    for 2-channel networks, n + m for descriptors, n + m plus n * m head passes for ``siam``)."""
    m = to_device(build_patch_model(name, size, width), device).eval()
    a = torch.randn(n, 1, size, size, device=device)
    b = torch.randn(n, 1, size, size, device=device)
    t = time.perf_counter()
    score_matrix(m, a, b)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--width", type=float, default=0.125)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    names = ["2ch-2stream", "2ch-deep", "2ch", "siam", "siam-l2", "siam-2stream-l2", "hardnet"]
    items = per_item(names, args.size, args.width, args.batch, args.repeats, args.device)
    matching = {name: {n: match_all(name, n, args.size, args.width, args.device) for n in args.n}
                for name in ("2ch", "2ch-2stream", "siam", "siam-l2", "hardnet")}
    result = {"device": args.device, "size": args.size, "width": args.width, "threads": args.threads,
              "per_item": items, "matching_seconds": matching}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"device {args.device}, {args.size} x {args.size} patches, width {args.width}, {args.threads} threads")
    print(f"{'network':16s} {'pairs/s':>10s} {'descr/s':>10s} {'pairs/s from descr':>20s}")
    for name, r in items.items():
        d = f"{r['descriptors_per_s']:10.0f}" if "descriptors_per_s" in r else f"{'-':>10s}"
        p = f"{r['pairs_from_descriptors_per_s']:20.0f}" if "pairs_from_descriptors_per_s" in r else f"{'-':>20s}"
        print(f"{name:16s} {r['pairs_per_s']:10.0f} {d} {p}")
    print("\nall-pairs matching, n x n patches (seconds):")
    print(f"{'network':16s} " + " ".join(f"{'n=' + str(n):>10s}" for n in args.n))
    for name, row in matching.items():
        print(f"{name:16s} " + " ".join(f"{row[n]:10.3f}" for n in args.n))
    c2 = 1.0 / items["2ch"]["pairs_per_s"]
    cd = 1.0 / items["siam-l2"]["descriptors_per_s"]
    print(f"\ncost model: 2ch n*m*{c2 * 1e6:.0f} us vs siam-l2 (n+m)*{cd * 1e6:.0f} us (+ n*m distances): "
          f"descriptors win once n*m/(n+m) > {cd / c2:.2f}, i.e. n = m > {2 * cd / c2:.1f}")


if __name__ == "__main__":
    main()
