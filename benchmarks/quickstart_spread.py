"""Spread of the quickstart test's numbers across config seeds (and, run on each, across CPUs).

``tests/test_training_quickstart.py`` asserts that 40 steps of ``configs/quickstart.yaml`` beat
the untrained network; its bounds must hold on every CPU this project runs on, so they are set
from this sweep with margin, not from one machine's value. Prints one JSON line per seed::

    python benchmarks/quickstart_spread.py --data-root ../shared/data --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from dmlkit.apps import load_omniglot_one_shot_runs, omniglot_one_shot_error  # noqa: E402
from dmlkit.apps.fewshot import checkpoint_image_embedder  # noqa: E402
from dmlkit.training import build_datasets, build_model, embed_split, load_config, train  # noqa: E402
from dmlkit.utils import seed_everything  # noqa: E402
from test_training_quickstart import (  # noqa: E402  (the test's own settings and helpers)
    CONFIG,
    SHORT_RUN,
    _first_classes,
    _metrics,
    _negative_cosines,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = load_omniglot_one_shot_runs(args.data_root)
    for seed in args.seeds:
        config = load_config(CONFIG, [*SHORT_RUN, f"data.root={args.data_root}", f"seed={seed}"])
        sets = build_datasets(config, ("train", "val", "test"))
        train_set, val_set = _first_classes(sets["train"], 200), _first_classes(sets["val"], 20)
        test_set = _first_classes(sets["test"], 100)
        seed_everything(config.seed)
        emb0, lab0 = embed_split(build_model(config).eval(), test_set, config, "cpu")
        before = _metrics(emb0, lab0)
        out = Path(tempfile.mkdtemp(prefix=f"quickstart{seed}-"))
        try:
            result = train(config, out / "run", train_set=train_set, val_set=val_set,
                           test_set=test_set, progress=False)
            npz = np.load(out / "run" / "embeddings" / "test.npz")
            neg = _negative_cosines(npz["embeddings"], npz["labels"])
            one_shot = omniglot_one_shot_error(checkpoint_image_embedder(out / "run"), runs)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        after = {k: result.test_metrics[k] for k in ("precision_at_1", "map_at_r")}
        print(json.dumps({"seed": seed, "before": before, "after": after,
                          "median_negative_cosine": float(np.median(neg)),
                          "one_shot_error_percent": one_shot["error_percent"],
                          "per_run_error_percent": one_shot["per_run_error_percent"]}), flush=True)


if __name__ == "__main__":
    main()
