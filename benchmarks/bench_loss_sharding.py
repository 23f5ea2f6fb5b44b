"""Loss time per rank: replicated vs ``local_anchors`` (``dmlkit.losses.sharding``), W gloo ranks.

Each rank holds its share ``b = B / W`` of a global batch of L2-normalised 128-d embeddings
(``B / 4`` classes x 4 samples, synthetic: timing does not depend on the values), gathers it
with gradient (``all_gather_with_grad``), runs the miner on the gathered batch (both modes: it
is not sharded) and then the loss, forward + backward:

* ``replicated``: ``loss_fn(E)`` on the whole gathered batch (what every rank does by default);
* ``local_anchors``: ``sharded_loss(loss_fn, E)`` (this rank's anchors against the whole batch,
  counts all-reduced), back-propagated as ``W * L_r`` as the trainer does.

Timed per rank: ``loss`` = gather + loss forward + backward (through the gather's all-reduce),
``miner`` = the miner's call. Every repetition starts at a barrier; the two modes alternate;
the table gives the median over ``--repeats`` repetitions (after one warm-up) of the slowest
rank and the ratio replicated / local_anchors. Each rank uses ``--threads`` threads.

Run: nice -n 10 python benchmarks/bench_loss_sharding.py --batch 1024 4096 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

CASES = {  # name: (loss, loss params, miner)
    "contrastive": ("contrastive", {}, None),
    "triplet (all triplets)": ("triplet", {}, None),
    "triplet + semi_hard": ("triplet", {}, "semi_hard"),
    "multi_similarity + miner": ("multi_similarity", {}, "multi_similarity"),
}


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from dmlkit.distributed import all_gather_with_grad, init_distributed, shutdown
    from dmlkit.losses import get_loss
    from dmlkit.losses.sharding import sharded_loss
    from dmlkit.miners import get_miner

    init_distributed("cpu", timeout_s=1200)
    results = {}
    for batch in args.batch:
        b = batch // world
        g = torch.Generator().manual_seed(rank)
        x = torch.nn.functional.normalize(torch.randn(b, 128, generator=g), dim=1).requires_grad_(True)
        labels = torch.arange(batch // 4).repeat_interleave(4)[rank * b:(rank + 1) * b]
        for case, (name, params, miner_name) in CASES.items():
            loss_fn = get_loss(name, **params)
            miner = get_miner(miner_name) if miner_name else None
            times: dict[str, list[float]] = {"replicated": [], "local_anchors": [],
                                             "miner": []}
            for rep in range(args.repeats + 1):
                for mode in ("replicated", "local_anchors"):
                    dist.barrier()
                    t0 = time.perf_counter()
                    emb = all_gather_with_grad(x)
                    y = all_gather_with_grad(labels)
                    t1 = time.perf_counter()
                    idx = miner(emb, y) if miner is not None else None
                    t2 = time.perf_counter()
                    if mode == "replicated":
                        objective = loss_fn(emb, y, idx)
                    else:
                        objective = sharded_loss(loss_fn, emb, y, idx) * world
                    x.grad = None
                    objective.backward()
                    t3 = time.perf_counter()
                    if rep:
                        times[mode].append((t1 - t0) + (t3 - t2))
                        if mode == "replicated":
                            times["miner"].append(t2 - t1)
            results[(batch, case)] = times
    queue.put((rank, results))
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue))
             for r in range(args.world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"W = {args.world} gloo ranks, {args.threads} thread(s) each, median of {args.repeats} "
          "repetitions, slowest rank (ms)\n")
    print("| global B | loss (+ miner) | miner | loss replicated | loss local_anchors | ratio |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for batch in args.batch:
        for case in CASES:
            slowest = {k: [max(per_rank[r][(batch, case)][k][i] for r in per_rank)
                           for i in range(args.repeats)]
                       for k in ("replicated", "local_anchors", "miner")}
            med = {k: 1000 * statistics.median(v) for k, v in slowest.items()}
            miner = f"{med['miner']:.1f}" if CASES[case][2] else "-"
            print(f"| {batch} | {case} | {miner} | {med['replicated']:.1f} | "
                  f"{med['local_anchors']:.1f} | {med['replicated'] / med['local_anchors']:.2f}x |")


if __name__ == "__main__":
    main()
