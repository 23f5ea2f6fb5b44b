"""Training throughput: dmlkit's trainer vs the same model/loss/miner/batches in a plain
pytorch-metric-learning loop.

Both sides get the identical model (``dmlkit.training.build_model`` from the same seed), the
identical batches (``dmlkit.samplers.MPerClassSampler`` with the same seed, through the same
``DataLoader``/transforms) and the same optimiser; the peer side replaces dmlkit's trainer,
loss and miner with pytorch-metric-learning's (``TripletMarginLoss`` + ``BatchHardMiner``, or
``MultiSimilarityLoss`` + ``MultiSimilarityMiner``) in a hand-written loop (no validation,
logging or checkpoints). dmlkit's time is the whole
``train()`` loop as a user runs it: logging to ``log.jsonl`` and an atomic checkpoint at every
epoch end included (validation is off on both sides).

Scenarios:
  * ``omniglot-cnn``: configs/quickstart.yaml (small CNN, 28 x 28 Omniglot with augmentation,
    batch 32 x 4, triplet + batch-hard miner);
  * ``frozen-features``: configs/att_faces_efficientnet.yaml (a linear head on cached 1280-d
    EfficientNet-Lite0 features, batch 8 x 4, multi-similarity + its miner), where per-step
    overhead matters most.

Run:  python benchmarks/bench_train.py --data-root ../shared/data [--repeats 3] [--steps 60]
      [--out FILE.md]
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
    from dmlkit.training import load_config

    if scenario == "omniglot-cnn":  # the quickstart's model, loss, miner and batches
        return load_config(REPO / "configs" / "quickstart.yaml", [
            "training.epochs=2", f"sampler.batches_per_epoch={steps // 2}", "training.device=cpu",
            "training.patience=null",
        ])
    # frozen EfficientNet-Lite0 features of AT&T faces, linear head, multi-similarity + miner
    return load_config(REPO / "configs" / "att_faces_efficientnet.yaml", [
        "training.epochs=2", f"sampler.batches_per_epoch={steps // 2}", "training.device=cpu",
        "training.patience=null",
    ])


def _datasets(cfg, data_root: Path | None):
    """The training dataset; in frozen-trunk mode also the cached trunk features."""
    import warnings

    from dmlkit.embeddings import InferenceOptions, trunk_features
    from dmlkit.training import build_datasets, build_model

    train_set = build_datasets(cfg, ("train",), data_root=data_root)["train"]
    if not cfg.model.frozen_trunk:
        return train_set, train_set
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        feats = trunk_features(build_model(cfg), train_set, InferenceOptions.from_config(cfg, "cpu"))
    return train_set, feats


def run_dmlkit(cfg, train_set, _features) -> tuple[float, int]:
    """dmlkit's train() as a user runs it (log.jsonl, checkpoints), no validation."""
    import warnings

    from dmlkit.training import train

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no validation classes"
        result = train(cfg, Path(tmp) / "run", train_set=train_set, progress=False)
    return result.train_seconds, result.steps


def run_pml(cfg, train_set, features) -> tuple[float, int]:
    """The same model, batches and optimiser in a plain loop with pml's loss and miner."""
    from pytorch_metric_learning import losses, miners

    from dmlkit.samplers import MPerClassSampler
    from dmlkit.training import build_model
    from dmlkit.utils import seed_everything

    seed_everything(cfg.seed)
    model = build_model(cfg)
    if cfg.loss.name == "triplet":
        loss_fn = losses.TripletMarginLoss(margin=cfg.loss.params.get("margin", 0.2))
        miner = miners.BatchHardMiner()
    else:
        loss_fn, miner = losses.MultiSimilarityLoss(), miners.MultiSimilarityMiner()
    frozen = cfg.model.frozen_trunk
    step_fn = model.embed_features if frozen else model
    params = [p for p in (model.embedder if frozen else model).parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.optimizer.embedder_lr, weight_decay=cfg.optimizer.weight_decay)
    data = features if frozen else train_set
    classes = torch.as_tensor(np.unique(data.labels))
    sampler = MPerClassSampler(np.asarray(data.labels), cfg.sampler.samples_per_class,
                               cfg.sampler.classes_per_batch, cfg.sampler.batches_per_epoch,
                               seed=cfg.seed)
    steps = 0
    t0 = time.perf_counter()
    for epoch in range(cfg.training.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in DataLoader(data, batch_sampler=sampler):
            y = torch.searchsorted(classes, y)
            emb = step_fn(x)
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
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (at most 2)")
    parser.add_argument("--out", type=Path, default=None, help="write a Markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, args.threads)))
    import pytorch_metric_learning

    rows = []
    for scenario in args.scenarios:
        cfg = _config(scenario, args.steps)
        train_set, features = _datasets(cfg, args.data_root)
        batch = cfg.sampler.classes_per_batch * cfg.sampler.samples_per_class
        run_dmlkit(cfg, train_set, features)  # warm-up (imports, allocator, caches)
        ours, peer = [], []
        for _ in range(args.repeats):
            for runner, sink in ((run_dmlkit, ours), (run_pml, peer)):  # interleaved
                seconds, steps = runner(cfg, train_set, features)
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
            f"`torch.set_num_threads({max(1, min(2, args.threads))})`; median of {args.repeats} interleaved runs after a warm-up.\n\n"
            f"{table}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
