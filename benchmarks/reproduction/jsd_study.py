"""Seed 004's experiments with dmlkit: per-epoch JSD of positive/negative histograms vs MAP@R and P@1.

Oi, Kawakami & Naemura, "Analysis of Evaluation Metrics with the Distance between Positive
Pairs and Negative Pairs in Deep Metric Learning": split the classes 4:1:5 into train /
validation / test, in the dataset's default class order and in a random order (seed 1), train,
and after every epoch measure on each split

* the Jensen-Shannon divergence (base 2, in [0, 1]) of the histogram of cosine similarities of
  all positive pairs and that of all negative pairs, each normalised to area 1
  (:func:`dmlkit.metrics.pos_neg_histograms`, 100 bins on [-1, 1]);
* P@1 (= Recall@1) and MAP@R (:func:`dmlkit.metrics.evaluate`, exact kNN);
* the mean cosine of positive and of negative pairs (the paper's Fig. 2; from the histogram
  counts, so to within half a bin, 0.01).

The trainer is dmlkit's own (:class:`dmlkit.training.Trainer`), driven epoch by epoch from here
(``run_epoch`` / ``end_epoch``) so that nothing is added to the training loop. Settings are the
fixed part of ``benchmarks/reproduction/omniglot.yaml`` (small CNN from scratch, 64-d, Adam 1e-3,
8 x 4 / 32 x 1 batches) on two datasets: Omniglot (first 200 classes) and Binary Alphadigits
(36 classes), both 28 x 28; only the number of epochs differs (long enough to overfit).

    python benchmarks/reproduction/jsd_study.py run --data-root ../shared/data      # resumable
    python benchmarks/reproduction/jsd_study.py analyse                             # tables + figures

``run`` writes one JSON per (dataset, order, method) under ``runs/reproduction/jsd/`` and
gathers them into ``benchmarks/reproduction/results/jsd.json``; ``analyse`` computes (a) the
Pearson/Spearman correlation of JSD with MAP@R across epochs and methods, (b) whether the
train-minus-validation JSD gap rises before validation MAP@R falls, (c) default-vs-random test
scores at the best validation epoch, into ``results/jsd_analysis.{json,md}`` and
``figures/jsd_*.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = HERE / "results"
FIGURES = HERE / "figures"
ORDERS = ("default", "random")
ORDER_SEED = 1  # the paper: "We set the random seed to 1."
BINS = 100

#: dataset -> (dmlkit dataset name, number of classes kept (first in id order), epochs, batches/epoch)
DATASETS: dict[str, tuple[str, int | None, int, int]] = {
    "omniglot": ("omniglot", 200, 20, 25),
    "alphadigits": ("binary_alphadigits", None, 30, 10),
}
#: method -> (loss, loss params, miner, miner params); NSL with s = 10 as in the paper.
METHODS: dict[str, tuple[str, dict[str, Any], str | None, dict[str, Any]]] = {
    "normalized_softmax": ("normalized_softmax", {"temperature": 0.1}, None, {}),
    "contrastive": ("contrastive", {}, None, {}),
    "triplet": ("triplet", {}, "semi_hard", {}),
    "ms+miner": ("multi_similarity", {}, "multi_similarity", {}),
    "arcface": ("arcface", {}, None, {}),
}


# -- running -----------------------------------------------------------------------------------
def experiment_config(dataset: str, method: str, n_train_classes: int, seed: int, epochs: int | None = None):
    """The training config: the fixed settings of omniglot.yaml with this dataset and method."""
    from dmlkit.config import config_from_dict
    from dmlkit.losses import LOSSES

    name, _, default_epochs, batches = DATASETS[dataset]
    epochs = epochs or default_epochs
    loss, loss_params, miner, miner_params = METHODS[method]
    if getattr(LOSSES[loss], "requires_num_classes", False):  # C x 1 batches for classification losses
        c = min(32, n_train_classes)
        sampler = {"classes_per_batch": c, "samples_per_class": max(1, 32 // c), "batches_per_epoch": batches}
    else:
        sampler = {"classes_per_batch": 8, "samples_per_class": 4, "batches_per_epoch": batches}
    return config_from_dict({
        "name": f"jsd-{dataset}-{method}",
        "seed": seed,
        "data": {"dataset": name, "transform": "grayscale", "image_size": 28},
        "model": {"trunk": "small_cnn", "trunk_options": {"bn_neck": True}, "pretrained": False,
                  "in_channels": 1, "embedding_size": 64, "head": "linear", "normalize": True,
                  "freeze_batchnorm": False},
        "loss": {"name": loss, "params": dict(loss_params)},
        "miner": None if miner is None else {"name": miner, "params": dict(miner_params)},
        "sampler": sampler,
        "optimizer": {"preset": "cpu_quick"},
        "training": {"epochs": epochs, "eval_every_epochs": 1, "device": "cpu", "log_every": batches,
                     "eval_metrics": ["precision_at_1", "map_at_r"]},
    }, source=f"jsd study ({dataset}, {method})")


def split_sets(dataset: str, order: str, data_root: str | None):
    """Train (augmented), train (evaluation transform), validation and test sets of the 4:1:5 split."""
    from dmlkit.data import get_transforms, load_dataset
    from dmlkit.protocol import make_bench_split
    from dmlkit.utils import data_root as resolve_root

    name, num_classes, _, _ = DATASETS[dataset]
    full = load_dataset(name, root=resolve_root(data_root))
    classes = sorted(int(c) for c in np.unique(full.labels))[:num_classes]
    split = make_bench_split(classes, "ratio_4_1_5", order=order, seed=ORDER_SEED, folds=1)
    train_tf = get_transforms("grayscale", train=True, image_size=28)
    eval_tf = get_transforms("grayscale", train=False, image_size=28)
    fold = split.folds[0]
    sets = {
        "train_aug": full.subset_classes(list(fold.train)).with_transform(train_tf),
        "train": full.subset_classes(list(fold.train)).with_transform(eval_tf),
        "val": full.subset_classes(list(fold.val)).with_transform(eval_tf),
        "test": full.subset_classes(list(split.test)).with_transform(eval_tf),
    }
    return sets, split


def measure(model, sets: dict[str, Any], options, keep_hist: bool) -> dict[str, Any]:
    """P@1, MAP@R, JSD and mean positive/negative cosine of each split (train, val, test)."""
    from dmlkit.embeddings import embed_model
    from dmlkit.metrics import evaluate, pos_neg_histograms

    out: dict[str, Any] = {}
    for split in ("train", "val", "test"):
        emb, lab = embed_model(model, sets[split], options)
        m = evaluate(emb, lab, metrics=["precision_at_1", "map_at_r"])
        h = pos_neg_histograms(emb, lab, bins=BINS)
        centers = (h.edges[:-1] + h.edges[1:]) / 2
        row = {"precision_at_1": float(m["precision_at_1"]), "map_at_r": float(m["map_at_r"]),
               "jsd": float(h.js),
               "pos_mean": float((h.pos_counts * centers).sum() / h.pos_counts.sum()),
               "neg_mean": float((h.neg_counts * centers).sum() / h.neg_counts.sum()),
               "num_classes": int(np.unique(lab).size)}
        if keep_hist:
            row["pos_density"] = [round(float(v), 5) for v in h.pos_density]
            row["neg_density"] = [round(float(v), 5) for v in h.neg_density]
        out[split] = row
    return out


def run_one(dataset: str, order: str, method: str, seed: int, out_dir: Path, data_root: str | None,
            epochs: int | None = None) -> Path:
    """Train one model epoch by epoch and record the curves; skipped if its JSON exists."""
    import torch

    from dmlkit.training import Trainer
    from dmlkit.utils import atomic_write_json, seed_everything

    result = out_dir / f"{dataset}-{order}-{method}-seed{seed}.json"
    if result.exists():
        return result
    sets, split = split_sets(dataset, order, data_root)
    cfg = experiment_config(dataset, method, len(split.folds[0].train), seed, epochs)
    run_dir = out_dir / result.stem
    seed_everything(cfg.seed)
    trainer = Trainer(cfg, run_dir, sets["train_aug"], sets["val"], device="cpu")
    edges = np.linspace(-1.0, 1.0, BINS + 1)
    epochs = [{"epoch": 0, "step": 0, **measure(trainer.model, sets, trainer.options, keep_hist=True)}]
    t0 = time.perf_counter()
    state = trainer.state
    try:
        while state.epoch < cfg.training.epochs:
            trainer.run_epoch(t0)
            state.epoch += 1
            state.elapsed = time.perf_counter() - t0
            if state.epoch >= cfg.training.epochs:
                state.stop_reason = "epochs"
            trainer.end_epoch()
            with torch.no_grad():
                rec = measure(trainer.model, sets, trainer.options, keep_hist=state.epoch == cfg.training.epochs)
            epochs.append({"epoch": state.epoch, "step": state.step, **rec})
            print(f"{result.stem} epoch {state.epoch}: " + "  ".join(
                f"{s} JSD {rec[s]['jsd']:.3f} MAP@R {rec[s]['map_at_r']:.3f}" for s in ("train", "val", "test")),
                flush=True)
    finally:
        trainer.run_log.close()
    atomic_write_json(result, {
        "dataset": dataset, "order": order, "order_seed": ORDER_SEED, "method": method, "seed": seed,
        "loss": cfg.loss.model_dump(mode="json"), "miner": None if cfg.miner is None else cfg.miner.model_dump(mode="json"),
        "classes": {"train": list(split.folds[0].train), "val": list(split.folds[0].val), "test": list(split.test)},
        "bins": BINS, "edges": edges.round(4).tolist(), "train_seconds": round(state.elapsed, 1),
        "epochs": epochs,
    })
    return result


def cmd_run(a: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(a.threads)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for method in a.method or list(METHODS):  # method-major: a cut-short run has both orders of each method
        for dataset in a.dataset or list(DATASETS):
            for order in ORDERS:
                for seed in a.seeds:
                    t = time.perf_counter()
                    files.append(run_one(dataset, order, method, seed, out_dir, a.data_root, a.epochs))
                    print(f"done {files[-1].name} ({time.perf_counter() - t:.0f} s)", flush=True)
                    if a.epochs is None:
                        gather(out_dir)
    return 0


def gather(out_dir: Path) -> Path:
    """All finished runs in one small JSON beside the document."""
    from dmlkit.utils import atomic_write_text

    runs = [json.loads(p.read_text()) for p in sorted(out_dir.glob("*-seed*.json"))]
    for run in runs:  # keep the histograms of the test split only (Fig. 3): the file stays small
        for epoch in run["epochs"]:
            for split in ("train", "val"):
                epoch[split].pop("pos_density", None)
                epoch[split].pop("neg_density", None)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "jsd.json"
    atomic_write_text(path, json.dumps({"paper": "Oi, Kawakami & Naemura (seed 004)", "runs": runs},
                                       separators=(",", ":")) + "\n")
    return path


# -- analysis ----------------------------------------------------------------------------------
def series(run: dict[str, Any], split: str, key: str) -> np.ndarray:
    return np.array([e[split][key] for e in run["epochs"]], dtype=np.float64)


def correlations(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(a) Pearson and Spearman r of JSD with MAP@R (and P@1), pooled over epochs and methods;
    and the Spearman r of their epoch-to-epoch changes (both rise as training goes on, so the
    levels correlate through the trend alone; the changes test whether they move together)."""
    from scipy.stats import pearsonr, spearmanr

    rows = []
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        for split in ("train", "val", "test"):
            groups.setdefault((r["dataset"], r["order"], split), []).append(r)
    for (dataset, order, split), rs in sorted(groups.items()):
        jsd = np.concatenate([series(r, split, "jsd") for r in rs])
        row = {"dataset": dataset, "order": order, "split": split, "n": int(jsd.size), "methods": len(rs)}
        for key in ("map_at_r", "precision_at_1"):
            other = np.concatenate([series(r, split, key) for r in rs])
            row[f"pearson_{key}"] = float(pearsonr(jsd, other)[0])
            row[f"spearman_{key}"] = float(spearmanr(jsd, other)[0])
        # epoch-to-epoch changes: does JSD follow MAP@R beyond the common upward trend of training?
        d_jsd = np.concatenate([np.diff(series(r, split, "jsd")) for r in rs])
        d_map = np.concatenate([np.diff(series(r, split, "map_at_r")) for r in rs])
        row["spearman_diff_map_at_r"] = float(spearmanr(d_jsd, d_map)[0])
        rows.append(row)
    return rows


def overfitting(run: dict[str, Any], gap_rise: float = 0.02, map_drop: float = 0.005) -> dict[str, Any]:
    """(b) Does the train-minus-validation JSD gap rise before validation MAP@R falls?

    ``gap_onset``: the first epoch whose gap exceeds the epoch-0 gap by ``gap_rise`` (0.02) and
    stays above that level for the rest of the run. ``map_cross``: the first epoch at which the
    training MAP@R exceeds the validation MAP@R (the paper's "reversal"; the validation split
    has 4x fewer classes, so its MAP@R starts higher). ``val_peak``: the epoch of the best
    validation MAP@R; ``val_falls``: the last epoch's validation MAP@R is more than ``map_drop``
    (0.5 points) below the peak. ``flags_first``: the gap onset precedes the peak.
    """
    gap = series(run, "train", "jsd") - series(run, "val", "jsd")
    val = series(run, "val", "map_at_r")
    level = gap[0] + gap_rise
    above = gap > level
    onset = None
    for e in range(len(gap)):
        if above[e:].all():
            onset = e
            break
    peak = int(np.argmax(val))
    train_map = series(run, "train", "map_at_r")
    crossed = np.nonzero(train_map > val)[0]
    return {"dataset": run["dataset"], "order": run["order"], "method": run["method"], "seed": run["seed"],
            "gap_epoch0": float(gap[0]), "gap_last": float(gap[-1]), "gap_onset": onset,
            "val_peak": peak, "val_peak_map_at_r": float(val[peak]), "val_last_map_at_r": float(val[-1]),
            "val_falls": bool(val[-1] < val[peak] - map_drop),
            "flags_first": None if onset is None else bool(onset < peak),
            "train_map_last": float(train_map[-1]),
            "map_cross": int(crossed[0]) if crossed.size else None}


def order_effect(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(c) Test P@1, MAP@R and JSD at the best-validation-MAP@R epoch, default vs random order."""
    at_best: dict[tuple[str, str, int], dict[str, dict[str, float]]] = {}
    for r in runs:
        best = int(np.argmax(series(r, "val", "map_at_r")))
        test = r["epochs"][best]["test"]
        at_best.setdefault((r["dataset"], r["method"], r["seed"]), {})[r["order"]] = {
            "epoch": best, **{k: float(test[k]) for k in ("precision_at_1", "map_at_r", "jsd")}}
    rows = []
    for (dataset, method, seed), by_order in sorted(at_best.items()):
        if set(by_order) != set(ORDERS):
            continue
        d, r = by_order["default"], by_order["random"]
        rows.append({"dataset": dataset, "method": method, "seed": seed, "default": d, "random": r,
                     **{f"diff_{k}": r[k] - d[k] for k in ("precision_at_1", "map_at_r", "jsd")}})
    return rows


def markdown(corr: list[dict[str, Any]], over: list[dict[str, Any]], order: list[dict[str, Any]]) -> str:
    lines = ["### (a) Correlation of JSD with MAP@R and P@1 (pooled over epochs and methods)", "",
             "| dataset | order | split | n | Pearson MAP@R | Spearman MAP@R | Pearson P@1 | Spearman P@1 | "
             "Spearman of per-epoch changes (JSD vs MAP@R) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in corr:
        lines.append(f"| {r['dataset']} | {r['order']} | {r['split']} | {r['n']} | {r['pearson_map_at_r']:.3f} | "
                     f"{r['spearman_map_at_r']:.3f} | {r['pearson_precision_at_1']:.3f} | "
                     f"{r['spearman_precision_at_1']:.3f} | {r['spearman_diff_map_at_r']:.3f} |")
    lines += ["", "### (b) Train-minus-validation JSD gap vs validation MAP@R", "",
              "| dataset | order | method | gap epoch 0 | gap last | gap onset | val peak epoch | val MAP@R peak | "
              "val MAP@R last | val falls | onset before peak | train MAP@R > val from |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in over:
        onset = "-" if r["gap_onset"] is None else str(r["gap_onset"])
        first = "-" if r["flags_first"] is None else ("yes" if r["flags_first"] else "no")
        lines.append(f"| {r['dataset']} | {r['order']} | {r['method']} | {r['gap_epoch0']:+.3f} | {r['gap_last']:+.3f} | "
                     f"{onset} | {r['val_peak']} | {100 * r['val_peak_map_at_r']:.2f} | "
                     f"{100 * r['val_last_map_at_r']:.2f} | {'yes' if r['val_falls'] else 'no'} | {first} | "
                     f"{'-' if r['map_cross'] is None else r['map_cross']} |")
    lines += ["", "### (c) Test scores at the best validation epoch: default vs random class order", "",
              "| dataset | method | P@1 default | P@1 random | MAP@R default | MAP@R random | JSD default | JSD random |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in order:
        d, x = r["default"], r["random"]
        lines.append(f"| {r['dataset']} | {r['method']} | {100 * d['precision_at_1']:.2f} | {100 * x['precision_at_1']:.2f} | "
                     f"{100 * d['map_at_r']:.2f} | {100 * x['map_at_r']:.2f} | {d['jsd']:.3f} | {x['jsd']:.3f} |")
    return "\n".join(lines) + "\n"


def cmd_analyse(a: argparse.Namespace) -> int:
    from dmlkit.utils import atomic_write_json, atomic_write_text

    runs = json.loads((RESULTS / "jsd.json").read_text())["runs"]
    if not runs:
        print("no finished runs in results/jsd.json", file=sys.stderr)
        return 1
    corr, over, order = correlations(runs), [overfitting(r) for r in runs], order_effect(runs)
    atomic_write_json(RESULTS / "jsd_analysis.json", {"correlations": corr, "overfitting": over, "order": order})
    atomic_write_text(RESULTS / "jsd_analysis.md", markdown(corr, over, order))
    sys.path.insert(0, str(HERE))
    from figures import jsd_figures

    for path in jsd_figures(runs, FIGURES):
        print(path)
    print((RESULTS / "jsd_analysis.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train and record per-epoch curves (resumable)")
    p.add_argument("--data-root", default=os.environ.get("DMLKIT_DATA"))
    p.add_argument("--out", default=str(REPO / "runs" / "reproduction" / "jsd"))
    p.add_argument("--dataset", action="append", choices=list(DATASETS))
    p.add_argument("--method", action="append", choices=list(METHODS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, help="override the epochs (smoke tests; write to another --out)")
    g = sub.add_parser("gather", help="collect the finished runs into results/jsd.json")
    g.add_argument("--out", default=str(REPO / "runs" / "reproduction" / "jsd"))
    sub.add_parser("analyse", help="correlations, overfitting onset, order effect, figures")
    a = parser.parse_args(argv)
    if a.command == "gather":
        print(gather(Path(a.out)))
        return 0
    return {"run": cmd_run, "analyse": cmd_analyse}[a.command](a)


if __name__ == "__main__":
    raise SystemExit(main())
