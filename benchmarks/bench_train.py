"""Training throughput: dmlkit's trainer vs the same model/loss/miner/batches in a plain
pytorch-metric-learning loop.

Both sides get the identical model (``dmlkit.training.build_model`` from the same seed), the
identical batches (``dmlkit.samplers.MPerClassSampler`` with the same seed, through the same
``DataLoader``/transforms) and the same optimiser; the peer side replaces dmlkit's trainer,
loss and miner with ``pml.losses.TripletMarginLoss`` + ``pml.miners.BatchHardMiner`` in a
hand-written loop (no validation, logging or checkpoints). dmlkit's time is the whole
``train()`` loop as a user runs it: logging to ``log.jsonl`` and an atomic checkpoint at every
epoch end included (validation is off on both sides).

Scenarios:
  * ``omniglot-cnn``: the quickstart's small CNN on 28 x 28 Omniglot images (augmentation on)
  * ``frozen-features``: a linear head on cached 1280-d features (the frozen-trunk mode), where
    per-step overhead matters most.

Run:  python benchmarks/bench_train.py [--repeats 3] [--steps 60] [--out docs/bench/training.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]


def _config(scenario: str, steps: int):
    from dmlkit.training import config_from_dict

    common = {
        "seed": 0,
        "loss": {"name": "triplet", "params": {"margin": 0.2}},
        "miner": {"name": "batch_hard"},
        "optimizer": {"preset": "cpu_quick"},
        "training": {"epochs": 2, "device": "cpu", "log_every": 10},
    }
    if scenario == "omniglot-cnn":
        return config_from_dict({
            **common, "name": "bench-omniglot",
            "data": {"dataset": "omniglot", "transform": "grayscale", "image_size": 28},
            "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1,
                      "embedding_size": 64, "freeze_batchnorm": False},
            "sampler": {"classes_per_batch": 32, "samples_per_class": 4,
                        "batches_per_epoch": steps // 2},
        })
    return config_from_dict({
        **common, "name": "bench-features",
        "data": {"dataset": "features"},
        "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1,
                  "embedding_size": 128, "freeze_batchnorm": False},
        "sampler": {"classes_per_batch": 8, "samples_per_class": 4, "batches_per_epoch": steps // 2},
    })


def _datasets(scenario: str, data_root: Path | None):
    from dmlkit.data import ArrayDataset, get_transforms, load_dataset

    if scenario == "omniglot-cnn":
        ds = load_dataset("omniglot", root=data_root, sets=("background",))
        return ds.subset_classes(range(200)).with_transform(
            get_transforms("grayscale", train=True, image_size=28))
    rng = np.random.default_rng(0)  # stand-in for cached trunk features: 200 classes x 20
    centres = rng.normal(size=(200, 1280)).astype(np.float32)
    labels = np.repeat(np.arange(200), 20)
    feats = centres[labels] + rng.normal(scale=2.0, size=(labels.size, 1280)).astype(np.float32)
    return ArrayDataset(feats, labels, kind="features", name="features")


class _Head(torch.nn.Module):
    """Linear head + L2 normalisation, the frozen-trunk model (same init on both sides)."""

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dim, size)

    def forward(self, x):
        return torch.nn.functional.normalize(self.linear(x), dim=1)


def run_dmlkit(scenario, cfg, dataset) -> tuple[float, int]:
    from dmlkit.training import train

    with tempfile.TemporaryDirectory() as tmp:
        if scenario == "frozen-features":
            import dmlkit.training.trainer as trainer

            original = trainer.build_model
            trainer.build_model = lambda config, **kw: _HeadModel(dataset.arrays.shape[1], 128)
            try:
                t0 = time.perf_counter()
                result = train(cfg, Path(tmp) / "run", train_set=dataset, progress=False)
                wall = time.perf_counter() - t0
            finally:
                trainer.build_model = original
        else:
            t0 = time.perf_counter()
            result = train(cfg, Path(tmp) / "run", train_set=dataset, progress=False)
            wall = time.perf_counter() - t0
    del wall
    return result.train_seconds, result.steps


class _HeadModel(torch.nn.Module):
    """An EmbeddingModel-shaped wrapper (empty trunk, linear embedder) for the features case."""

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.trunk = torch.nn.Identity()
        self.embedder = torch.nn.Linear(dim, size)
        self.embedding_size = size

    def forward(self, x):
        return torch.nn.functional.normalize(self.embedder(self.trunk(x)), dim=1)


def run_pml(scenario, cfg, dataset) -> tuple[float, int]:
    from pytorch_metric_learning import losses, miners

    from dmlkit.samplers import MPerClassSampler
    from dmlkit.training import build_model
    from dmlkit.utils import seed_everything

    seed_everything(cfg.seed)
    if scenario == "frozen-features":
        model = _HeadModel(dataset.arrays.shape[1], 128)
    else:
        model = build_model(cfg)
    loss_fn = losses.TripletMarginLoss(margin=0.2)
    miner = miners.BatchHardMiner()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.optimizer.embedder_lr,
                           weight_decay=cfg.optimizer.weight_decay)
    sampler = MPerClassSampler(dataset.labels, cfg.sampler.samples_per_class,
                               cfg.sampler.classes_per_batch, cfg.sampler.batches_per_epoch,
                               seed=cfg.seed)
    steps = 0
    t0 = time.perf_counter()
    for epoch in range(cfg.training.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in DataLoader(dataset, batch_sampler=sampler):
            emb = model(x)
            loss = loss_fn(emb, y, miner(emb, y))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
    return time.perf_counter() - t0, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="optimiser steps per run")
    parser.add_argument("--data-root", type=Path, default=None)
    parser.add_argument("--scenarios", nargs="+", default=["omniglot-cnn", "frozen-features"])
    parser.add_argument("--out", type=Path, default=None, help="write a Markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    import pytorch_metric_learning

    rows = []
    for scenario in args.scenarios:
        cfg = _config(scenario, args.steps)
        dataset = _datasets(scenario, args.data_root)
        batch = cfg.sampler.classes_per_batch * cfg.sampler.samples_per_class
        run_dmlkit(scenario, cfg, dataset)  # warm-up (imports, allocator, caches)
        ours, peer = [], []
        for _ in range(args.repeats):
            for runner, sink in ((run_dmlkit, ours), (run_pml, peer)):  # interleaved
                seconds, steps = runner(scenario, cfg, dataset)
                sink.append(steps * batch / seconds)
        med_ours, med_peer = statistics.median(ours), statistics.median(peer)
        rows.append((scenario, batch, args.steps, med_ours, med_peer, med_ours / med_peer))
        print(f"{scenario}: dmlkit {med_ours:.0f} samples/s, pml loop {med_peer:.0f} samples/s, "
              f"ratio {med_ours / med_peer:.2f}x  (runs: {[round(v) for v in ours]} vs "
              f"{[round(v) for v in peer]})", flush=True)

    lines = [
        "| scenario | batch | steps | dmlkit train() samples/s | pml plain loop samples/s | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *[f"| {s} | {b} | {n} | {o:.0f} | {p:.0f} | {r:.2f}x |" for s, b, n, o, p, r in rows],
    ]
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        cmd = "python benchmarks/bench_train.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            "# Training throughput: dmlkit trainer vs a plain pytorch-metric-learning loop\n\n"
            f"Command: `{cmd.strip()}`  \n"
            f"Machine: 2-core CPU, 24 GB, shared with other jobs ({platform.processor() or platform.machine()}); "
            f"torch {torch.__version__}, pytorch-metric-learning {pytorch_metric_learning.__version__}, "
            f"`torch.set_num_threads(2)`; median of {args.repeats} interleaved runs after a warm-up.\n\n"
            f"{table}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
