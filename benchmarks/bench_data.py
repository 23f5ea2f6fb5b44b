"""Data pipeline speed: dmlkit's Omniglot dataset vs torchvision's, and loading times.

Measures, on the real Omniglot data (``$DMLKIT_DATA`` or ``../shared/data``):

1. ``load_dataset("omniglot")`` wall time from the numpy copies (both sets, 32,460 images) and
   from the official zips (evaluation set);
2. sample throughput (samples / s, median of ``--repeats`` passes over the same ``--samples``
   indices) of ``ds[i]`` with the same transform (grayscale, resize 28, ToTensor, normalise):
   dmlkit's in-memory ``ArrayDataset`` vs ``torchvision.datasets.Omniglot`` reading the
   official PNGs (extracted from ``images_evaluation.zip`` into a temporary folder, as
   torchvision lays them out).

Run:  python benchmarks/bench_data.py [--samples 2000] [--repeats 3] [--markdown FILE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch


def _data_root() -> Path:
    env = os.environ.get("DMLKIT_DATA")
    root = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"
    if not (root / "omniglot").exists():
        sys.exit(f"Omniglot not found under {root}: set DMLKIT_DATA")
    return root


def _throughput(ds, indices, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in indices:
            ds[i]
        rates.append(len(indices) / (time.perf_counter() - t))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from torchvision import transforms as T
    from torchvision.datasets import Omniglot

    from dmlkit.data import load_dataset
    from dmlkit.utils import atomic_write_text

    root = _data_root()
    t = time.perf_counter()
    full = load_dataset("omniglot", root=root)
    t_npz = time.perf_counter() - t
    t = time.perf_counter()
    load_dataset("omniglot", root=root, source="zip", sets=["evaluation"])
    t_zip = time.perf_counter() - t

    # torchvision's dataset gives ink black on white; invert so both feed the same pixels
    tf_dmlkit = T.Compose([T.Resize((28, 28)), T.ToTensor(), T.Normalize((0.5,), (0.5,))])
    tf_tv = T.Compose([T.Resize((28, 28)), T.ToTensor(), T.Lambda(lambda x: 1.0 - x),
                       T.Normalize((0.5,), (0.5,))])
    ev = full.subset_group("evaluation").with_transform(tf_dmlkit)
    step = max(1, len(ev) // args.samples)
    indices = list(range(0, len(ev), step))[: args.samples]
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "omniglot-py"
        with zipfile.ZipFile(root / "omniglot" / "images_evaluation.zip") as zf:
            zf.extractall(target)
        # the shared zips are rebuilt from the npz copies, so torchvision's md5 check of the
        # original zip cannot pass: skip it (the PNG folder layout is the official one)
        class LocalOmniglot(Omniglot):
            def _check_integrity(self) -> bool:
                return True

        tv = LocalOmniglot(tmp, background=False, download=False, transform=tf_tv)
        # torchvision lists folders in file-system order; match samples by file name
        # XXXX_YY.png (global character id, drawer) = dmlkit row (XXXX - 965) * 20 + YY - 1
        def row(i: int) -> int:
            gid, drawer = tv._flat_character_images[i][0].removesuffix(".png").split("_")
            return (int(gid) - 965) * 20 + int(drawer) - 1

        same = all(torch.allclose(ev[row(i)][0], tv[i][0], atol=0.02) for i in (0, 1, 19, 20, 5000))
        r_dml = _throughput(ev, indices, args.repeats)
        r_tv = _throughput(tv, indices, args.repeats)

    cmd = "python benchmarks/bench_data.py " + " ".join(sys.argv[1:])
    lines = [
        "## Data pipeline (dmlkit.data)",
        "",
        f"Command: `{cmd.strip()}`  ",
        "Machine: 2-core CPU, 24 GB, shared with other jobs "
        f"({platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} threads).",
        "",
        "| what | dmlkit | torchvision | ratio |",
        "| --- | --- | --- | --- |",
        f"| load Omniglot, both sets (32,460 images) from the npz copies | {t_npz:.1f} s | - | - |",
        f"| load Omniglot evaluation (13,180 images) from the official zip | {t_zip:.1f} s | - | - |",
        f"| `ds[i]` with resize 28 + ToTensor + normalise, samples/s (median of {args.repeats}) "
        f"| {r_dml:,.0f} | {r_tv:,.0f} (PNG files) | {r_dml / r_tv:.2f}x |",
        "",
        f"Same pixels in both pipelines: {same}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        atomic_write_text(args.markdown, text)


if __name__ == "__main__":
    main()
