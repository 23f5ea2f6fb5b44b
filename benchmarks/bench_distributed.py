"""Data-parallel training: step time and peak memory of 1 vs W ranks at one global batch.

Every rank runs the recipe ``dmlkit train`` uses under torchrun (``docs/distributed.md``): its
contiguous share of one global ``C x M`` batch from a rank-aware ``MPerClassSampler``, the
model in ``DistributedDataParallel`` with training BatchNorm converted to global-batch
BatchNorm, embeddings and labels gathered with gradient (``all_gather_with_grad``), the miner
and the loss on the gathered global batch, one optimiser step. One rank runs the same loop
without a process group (what a 1-process ``dmlkit train`` does).

Definitions (global batch B the same for every W; each rank ``--threads`` threads):

* ``T_W``: the median wall time of one training step with W ranks (per step the slowest rank,
  since the step ends at the gradient all-reduce every rank waits for; median over the timed
  steps of a run, then median over ``--repeats`` runs, W = 1 and W interleaved);
* speed-up ``S = T_1 / T_W``; scaling efficiency ``E = T_1 / (W * T_W) = S / W`` (1 = the work
  split perfectly, 0.5 at W = 2 = no gain);
* peak memory: each rank process's peak resident set during one case (``VmHWM``, reset
  before the case: Python, torch, the data, the gathered batch and the loss's ``B x B``
  matrices), the largest over the ranks; "before step 1" is the resident set once the model
  and data are built.

Each run starts 1 or W fresh processes (spawn) that go through every case in turn, so the
interpreter and torch start once per run; runs alternate 1 rank, W ranks, 1 rank, ... The
allocator keeps memory an earlier case freed, so in such a run a case's peak is not its own:
``--fresh`` starts new processes for every case (use it for the memory columns).

Cases: ``cnn`` (dmlkit's SmallCNN trunk, 28 x 28 inputs, trained BatchNorm, linear 64-d head:
the trunk dominates the step) and ``features`` (a linear 512 -> 128 head on cached trunk
features, the Reality Check's frozen-trunk setting: the loss on the global batch dominates, and
every rank computes all of it); losses ``contrastive+batch_hard`` (a pair loss with a miner)
and ``proxy_anchor`` (a proxy loss with its own parameters). Inputs are synthetic tensors
(timing does not depend on their values; labels are 512 classes x 8 samples).

Run (CPU, gloo):   nice -n 10 python benchmarks/bench_distributed.py
GPU machine (NCCL, one GPU per rank):
                   python benchmarks/bench_distributed.py --backend nccl --device cuda --world 2 4 8 \\
                       --batch 256 1024 4096
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

CASES = ("cnn", "features")
LOSSES = ("contrastive+batch_hard", "proxy_anchor")
NUM_CLASSES, PER_CLASS, SAMPLES_PER_CLASS = 512, 8, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(case: str, loss_name: str, device):
    import torch
    from torch import nn

    from dmlkit.losses import get_loss
    from dmlkit.miners import get_miner
    from dmlkit.models import SmallCNN

    torch.manual_seed(0)
    if case == "cnn":
        model = nn.Sequential(SmallCNN(in_channels=1), nn.Linear(128, 64))
        dim, x = 64, torch.randn(NUM_CLASSES * PER_CLASS, 1, 28, 28)
    else:
        model = nn.Linear(512, 128)
        dim, x = 128, torch.randn(NUM_CLASSES * PER_CLASS, 512)
    labels = torch.arange(NUM_CLASSES).repeat_interleave(PER_CLASS)
    if loss_name == "contrastive+batch_hard":
        loss, miner = get_loss("contrastive"), get_miner("batch_hard")
    else:
        loss, miner = get_loss("proxy_anchor", num_classes=NUM_CLASSES, embedding_size=dim), None
    return model.to(device), loss.to(device), miner, x.to(device), labels.to(device)


def rank_main(rank: int, world: int, port: int, specs: list[dict], out_dir: str) -> None:
    """One rank: for every spec, warm-up steps then timed steps; writes rank<r>.json.

    The process (imports, process group) is shared by all specs; each spec's peak memory is
    the resident set's high-water mark, reset before the spec (``/proc/self/clear_refs``)."""
    import torch

    from dmlkit.distributed import init_distributed, shutdown

    first = specs[0]
    torch.set_num_threads(first["threads"])
    device = torch.device(first["device"] if first["device"] == "cpu" else f"cuda:{rank}")
    if world > 1:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                           "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
        init_distributed(first["device"], backend=first["backend"], timeout_s=1800)
    results = [_run_spec(spec, rank, world, device) for spec in specs]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown()


def _run_spec(spec: dict, rank: int, world: int, device) -> dict:
    import gc

    import torch
    import torch.nn.functional as F
    from torch import nn

    from dmlkit.distributed import all_gather_with_grad, barrier
    from dmlkit.models.sync_batchnorm import convert_sync_batchnorm
    from dmlkit.samplers import MPerClassSampler

    gc.collect()
    if world > 1:
        barrier()
    _reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, loss_fn, miner, x, labels = _build(spec["case"], spec["loss"], device)
    base_mib = _rss_now_mib()  # the process, its imports and the data, before the first step
    net: nn.Module = model
    if world > 1:
        model = convert_sync_batchnorm(model, device)
        net = nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])
    params = list(model.parameters()) + list(loss_fn.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-3)
    steps = spec["warmup"] + spec["steps"]
    sampler = MPerClassSampler(labels.cpu(), SAMPLES_PER_CLASS, spec["batch"] // SAMPLES_PER_CLASS,
                               batches_per_epoch=steps, seed=0, num_replicas=world, rank=rank)
    times = []
    for idx in sampler:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        idx_t = torch.as_tensor(idx, device=device)
        emb = F.normalize(net(x[idx_t]), dim=1)
        y = labels[idx_t]
        if world > 1:
            emb, y = all_gather_with_grad(emb), all_gather_with_grad(y)
        loss = loss_fn(emb, y, miner(emb, y) if miner is not None else None)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return {"times": times[spec["warmup"]:], "rss_mib": _peak_rss_mib(), "base_mib": base_mib,
            "gpu_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
            "loss": float(loss.detach())}


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
    except OSError:
        pass


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_now_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_once(specs: list[dict], world: int) -> list[dict]:
    """One run of ``world`` fresh processes (spawn) over every spec; per step the slowest rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(world, _free_port(), specs, out), nprocs=world,
                           start_method="spawn", join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    rows = []
    for i in range(len(specs)):
        per_rank = [r[i] for r in ranks]
        per_step = [max(r["times"][k] for r in per_rank) for k in range(len(per_rank[0]["times"]))]
        rows.append({"step_s": statistics.median(per_step), "rss_mib": max(r["rss_mib"] for r in per_rank),
                     "base_mib": max(r["base_mib"] for r in per_rank),
                     "gpu_mib": None if per_rank[0]["gpu_mib"] is None else max(r["gpu_mib"] for r in per_rank)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--loss", nargs="+", choices=LOSSES, default=list(LOSSES))
    parser.add_argument("--batch", nargs="+", type=int, default=[256, 1024], help="global batch sizes")
    parser.add_argument("--world", nargs="+", type=int, default=[2], help="rank counts compared with 1")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs per (case, W), interleaved")
    parser.add_argument("--fresh", action="store_true",
                        help="new processes for every case (peak memory of that case alone; slower)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    import torch

    print(f"# {_cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, python "
          f"{platform.python_version()}, backend {args.backend}, device {args.device}, "
          f"{args.threads} thread(s) per rank; load average at start {os.getloadavg()}")
    print("| model | loss | global B | W | T_1 (s/step) | T_W (s/step) | speed-up S | efficiency E = S/W "
          "| peak RSS per rank, 1 / W ranks (MiB) | of which training steps, 1 / W (MiB) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    specs = []
    for case in args.case:
        for loss in args.loss:
            for batch in args.batch:
                if batch % (SAMPLES_PER_CLASS * max(args.world)) or batch // SAMPLES_PER_CLASS > NUM_CLASSES:
                    print(f"skip B={batch}: B must be a multiple of {SAMPLES_PER_CLASS} x W and at most "
                          f"{NUM_CLASSES * SAMPLES_PER_CLASS}", file=sys.stderr)
                    continue
                specs.append({"case": case, "loss": loss, "batch": batch, "threads": args.threads,
                              "device": args.device, "backend": args.backend, "steps": args.steps,
                              "warmup": args.warmup})
    runs: dict[int, list[list[dict]]] = {w: [] for w in (1, *args.world)}
    for _ in range(args.repeats):  # interleaved: 1 rank, W ranks, 1 rank, ...
        for w in runs:
            if args.fresh:
                runs[w].append([run_once([spec], w)[0] for spec in specs])
            else:
                runs[w].append(run_once(specs, w))
    rows = []
    for i, spec in enumerate(specs):
        one = [rep[i] for rep in runs[1]]
        t1 = statistics.median(r["step_s"] for r in one)
        m1, b1 = max(r["rss_mib"] for r in one), max(r["base_mib"] for r in one)
        for world in args.world:
            many = [rep[i] for rep in runs[world]]
            tw = statistics.median(r["step_s"] for r in many)
            mw, bw = max(r["rss_mib"] for r in many), max(r["base_mib"] for r in many)
            inc1 = max(r["rss_mib"] - r["base_mib"] for r in one)
            incw = max(r["rss_mib"] - r["base_mib"] for r in many)
            row = {"case": spec["case"], "loss": spec["loss"], "batch": spec["batch"], "world": world, "t1": t1,
                   "tw": tw, "speedup": t1 / tw, "efficiency": t1 / (world * tw), "rss1_mib": m1, "rssw_mib": mw,
                   "base1_mib": b1, "basew_mib": bw, "steps1_mib": inc1, "stepsw_mib": incw, "gpu1_mib": one[0]["gpu_mib"], "gpuw_mib": many[0]["gpu_mib"],
                   "t1_runs": [r["step_s"] for r in one], "tw_runs": [r["step_s"] for r in many]}
            rows.append(row)
            print(f"| {spec['case']} | {spec['loss']} | {spec['batch']} | {world} | {t1:.3f} | {tw:.3f} | "
                  f"{t1 / tw:.2f}x | {row['efficiency']:.2f} | {m1:.0f} / {mw:.0f} | "
                  f"{inc1:.0f} / {incw:.0f} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"# load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
