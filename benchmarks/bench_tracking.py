"""Tracking speed: SiamFC frames per second at several network widths, and the NCC baseline.

Each tracker runs over the same offline sequence (real photographs, ``dmlkit.apps.tracking.
offline``) ``--repeats`` times, interleaved (width 1.0, 0.5, 0.25, ncc, then again), and the
median fps of the updates (first-frame initialisation excluded, as in the paper) is printed
with the ratio to the paper-width network measured in the same invocation.

    python benchmarks/bench_tracking.py --frames 20 --repeats 3 [--device cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from dmlkit.apps.tracking import NCCTracker, SiamFC, SiamFCTracker, TrackerConfig
from dmlkit.apps.tracking.offline import make_sequence, offline_specs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--widths", default="1.0,0.5,0.25")
    ap.add_argument("--scales", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    seq = make_sequence(offline_specs("test", 1, args.frames, seed=0)[0])
    frames, box = seq.frames, seq.boxes[0]
    cfg = TrackerConfig() if args.scales == 3 else TrackerConfig.five_scales()
    trackers = {f"siamfc w={w}": SiamFCTracker(SiamFC(width=float(w)), cfg, device=args.device)
                for w in args.widths.split(",")}
    trackers["ncc"] = NCCTracker()
    for t in trackers.values():  # warm-up (lazy imports, kernels)
        t.track(frames[:2], box)
    fps: dict[str, list[float]] = {name: [] for name in trackers}
    for _ in range(args.repeats):
        for name, t in trackers.items():
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            fps[name].append(t.track(frames, box).fps)
    med = {name: statistics.median(v) for name, v in fps.items()}
    ref = med.get("siamfc w=1.0", next(iter(med.values())))
    rows = {name: {"fps_median": m, "fps_all": fps[name], "ratio_to_w1": m / ref}
            for name, m in med.items()}
    info = {"device": args.device, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "frames": args.frames, "scales": args.scales,
            "torch": torch.__version__}
    if args.json:
        print(json.dumps({"info": info, "results": rows}, indent=2))
        return
    print(info)
    print(f"{'tracker':<16}{'median fps':>12}{'x w=1.0':>10}   all")
    for name, r in rows.items():
        runs = ", ".join(f"{v:.2f}" for v in r["fps_all"])
        print(f"{name:<16}{r['fps_median']:>12.2f}{r['ratio_to_w1']:>10.2f}   {runs}")


if __name__ == "__main__":
    main()
