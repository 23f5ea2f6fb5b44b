"""Loss (and miner) speed and memory: dmlkit vs pytorch-metric-learning, side by side.

For every dmlkit loss that pytorch-metric-learning (pml) also has (the table ``SPECS`` below,
built against ``dmlkit.losses.LOSSES``; losses not registered yet are skipped), at batch sizes
32, 256, 1024 and 4096 with 128-d float32 embeddings, it measures

* time of one forward + backward step (median over repeats, after one warm-up step),
* peak extra resident memory of that step,
* in float64 at B <= 256, the loss value and a gradient probe ``sum(grad * P)`` (``P`` a fixed
  random matrix), so that where the math is equivalent the two libraries can be checked to
  agree to 1e-5.

Embeddings are L2-normalised (the Reality Check protocol; pml's ``AngularLoss`` for one uses
the raw reference embeddings). Batches hold ``B / 4`` classes x 4 samples (the Reality Check's M = 4); proxy/classification
losses get 100 classes (labels ``(i // 4) mod 100``) and identical seeded weights on both
sides (transposed where pml stores ``W`` as ``(D, C)``). Miners are timed the same way
(forward only).

Each (loss, library) pair runs in a fresh subprocess, batch sizes in increasing order; before
each case the process frees what it can (``gc``, ``malloc_trim``), resets its peak-RSS counter
(``/proc/self/clear_refs``) and then reports ``VmHWM - VmRSS(before)``: the peak memory of that
case alone, including the embeddings' gradient and autograd buffers. An address-space cap
(``--mem-cap-gb``, default 6) makes an oversized allocation fail fast instead of swapping the
shared machine; such cases are reported as ``OOM``.

Close calls at B = 256 and 1024 (dmlkit slower than 0.9x pml) are measured a second time in
the reverse order and each library keeps its faster median (``--no-confirm`` to skip).

``--interleaved`` instead times both libraries in one process per loss, their steps
alternating, and reports the ratio of the medians (time only): the steadier comparison on a
busy machine. With ``--device cuda`` (interleaved only) both libraries run on the GPU: inputs
and proxy weights on the device, each step synchronised before its timer stops.

Run:  python benchmarks/bench_losses.py [--batch-sizes 32,256,1024,4096] [--only a,b]
          [--repeats 15] [--threads 1] [--markdown FILE.md] [--json out.json] [--interleaved]
      python benchmarks/bench_losses.py --interleaved --device cuda --batch-sizes 256,1024,4096
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EMBEDDING_SIZE = 128
SAMPLES_PER_CLASS = 4
PROXY_CLASSES = 100
CHECK_MAX_BATCH = 256
TOLERANCE = 1e-5


# ------------------------------------------------------------------------------------------
# What is compared with what
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One row: a dmlkit loss/miner and its pml counterpart with matching settings."""

    key: str
    name: str  # dmlkit registry name
    dml_kwargs: dict[str, Any]
    pml_class: str
    pml_kwargs: Callable[[Any], dict[str, Any]] = field(default=lambda pml: {})
    equivalent: bool = True
    kind: str = "loss"  # "loss", "proxy" or "miner"
    note: str = ""


def _pml_dist(name: str, **kw):
    def make(pml):
        return {"distance": getattr(pml.distances, name)(**kw)}

    return make


SPECS: list[Spec] = [
    # -- pair and triplet losses --------------------------------------------------------------
    Spec("contrastive", "contrastive", {}, "ContrastiveLoss",
         lambda pml: {"pos_margin": 0.0, "neg_margin": 1.0}),
    Spec("triplet", "triplet", {"margin": 0.2}, "TripletMarginLoss",
         lambda pml: {"margin": 0.2}, note="all triplets, mean over non-zero"),
    Spec("triplet_soft", "triplet", {"margin": 0.2, "soft_margin": True}, "TripletMarginLoss",
         lambda pml: {"margin": 0.2, "smooth_loss": True}, note="soft margin"),
    Spec("angular", "angular", {"alpha": 40.0}, "AngularLoss", lambda pml: {"alpha": 40},
         note="values equal; pml differentiates x_n without its L2 normalisation (it uses the "
              "raw reference embeddings), dmlkit through it, so the gradients differ"),
    Spec("margin", "margin", {}, "MarginLoss",
         lambda pml: {"margin": 0.2, "nu": 0.0, "beta": 1.2},
         equivalent=False,
         note="dmlkit: every pair once; pml: the pairs of every triplet (equal given the same triplets)"),
    Spec("lifted_structure", "lifted_structure", {}, "LiftedStructureLoss",
         lambda pml: {"neg_margin": 1.0, "pos_margin": 0.0}),
    Spec("generalized_lifted_structure", "generalized_lifted_structure", {},
         "GeneralizedLiftedStructureLoss", lambda pml: {"neg_margin": 1.0, "pos_margin": 0.0}),
    Spec("n_pairs", "n_pairs", {}, "NPairsLoss"),
    Spec("tuplet_margin", "tuplet_margin", {}, "TupletMarginLoss",
         lambda pml: {"margin": 5.73, "scale": 64}),
    Spec("circle", "circle", {}, "CircleLoss", lambda pml: {"m": 0.4, "gamma": 80}),
    Spec("multi_similarity", "multi_similarity", {}, "MultiSimilarityLoss",
         lambda pml: {"alpha": 2, "beta": 50, "base": 0.5}),
    Spec("ntxent", "ntxent", {"temperature": 0.1}, "NTXentLoss", lambda pml: {"temperature": 0.1}),
    Spec("supcon", "supcon", {"temperature": 0.1}, "SupConLoss", lambda pml: {"temperature": 0.1}),
    Spec("snr_contrastive", "snr_contrastive", {}, "SignalToNoiseRatioContrastiveLoss",
         lambda pml: {
             "pos_margin": 0.0, "neg_margin": 1.0,
             "distance": pml.distances.SNRDistance(normalize_embeddings=False),
             "embedding_regularizer": pml.regularizers.ZeroMeanRegularizer(),
             "embedding_reg_weight": 0.001,
         }, note="pml's SNRDistance with normalize_embeddings=False (dmlkit's default)"),
    Spec("nca", "nca", {}, "NCALoss", lambda pml: {"softmax_scale": 1}),
    Spec("fastap", "fastap", {"num_bins": 10}, "FastAPLoss", lambda pml: {"num_bins": 10}),
    Spec("ranked_list", "ranked_list", {"margin": 0.4, "Tn": 10.0, "Tp": 0.0}, "RankedListLoss",
         lambda pml: {"margin": 0.4, "Tn": 10, "Tp": 0}, equivalent=False,
         note="pml adds 1e-5 per column to each weight sum (relative difference about "
              "1e-5 B / #positives with Tp = 0) and skips negatives at distance 0; with those "
              "two deviations the formulas are equal (tests/test_losses_ranked_list.py)"),
    Spec("triplet_swap", "triplet", {"margin": 0.2, "swap": True}, "TripletMarginLoss",
         lambda pml: {"margin": 0.2, "swap": True}, note="anchor swap (Balntas et al. 2016)"),
    # -- classification and proxy losses -----------------------------------------------------
    Spec("normalized_softmax", "normalized_softmax", {"temperature": 0.05}, "NormalizedSoftmaxLoss",
         lambda pml: {"temperature": 0.05}, kind="proxy"),
    Spec("sphereface", "sphereface", {"margin": 4, "scale": 1.0}, "SphereFaceLoss",
         lambda pml: {"margin": 4, "scale": 1}, kind="proxy"),
    Spec("cosface", "cosface", {"margin": 0.35, "scale": 64.0}, "CosFaceLoss",
         lambda pml: {"margin": 0.35, "scale": 64}, kind="proxy"),
    Spec("arcface", "arcface", {"margin": 0.5, "scale": 64.0}, "ArcFaceLoss",
         lambda pml: {"margin": math.degrees(0.5), "scale": 64}, kind="proxy"),
    Spec("proxy_nca", "proxy_nca", {"scale": 1.0}, "ProxyNCALoss",
         lambda pml: {"softmax_scale": 1}, kind="proxy"),
    Spec("proxy_anchor", "proxy_anchor", {"margin": 0.1, "alpha": 32.0}, "ProxyAnchorLoss",
         lambda pml: {"margin": 0.1, "alpha": 32}, kind="proxy"),
    Spec("soft_triple", "soft_triple", {"tau": 0.0}, "SoftTripleLoss",
         lambda pml: {"centers_per_class": 10, "la": 20, "gamma": 0.1, "margin": 0.01},
         kind="proxy", note="tau = 0 (pml has no centre regulariser)"),
    # -- miners (forward only) ---------------------------------------------------------------
    # (cosine similarity on both sides: dmlkit's default, pml's default for these is Euclidean)
    Spec("miner:batch_hard", "batch_hard", {}, "BatchHardMiner", _pml_dist("CosineSimilarity"),
         kind="miner"),
    Spec("miner:batch_all", "batch_all", {"margin": 0.2}, "TripletMarginMiner",
         lambda pml: {"margin": 0.2, "type_of_triplets": "all", **_pml_dist("CosineSimilarity")(pml)},
         kind="miner"),
    Spec("miner:semi_hard(all)", "semi_hard", {"margin": 0.2, "negatives": "all"},
         "TripletMarginMiner",
         lambda pml: {"margin": 0.2, "type_of_triplets": "semihard",
                      **_pml_dist("CosineSimilarity")(pml)},
         kind="miner"),
    Spec("miner:multi_similarity", "multi_similarity", {"epsilon": 0.1}, "MultiSimilarityMiner",
         lambda pml: {"epsilon": 0.1}, kind="miner", note="pml's default is cosine too"),
]


# ------------------------------------------------------------------------------------------
# Worker: one (spec, library) in this process, batch sizes in order
# ------------------------------------------------------------------------------------------
def _status_kb(field_name: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field_name}:\s+(\d+)", text).group(1))


def _reset_peak() -> int:
    """Free what can be freed, reset VmHWM, return the current RSS in bytes."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - non-glibc
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") * 1024


def _peak_since(rss_before: int) -> int:
    return max(0, _status_kb("VmHWM") * 1024 - rss_before)


def _cap_memory(cap_gb: float) -> None:
    vm = _status_kb("VmSize") * 1024
    limit = int(vm + cap_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _build(spec: Spec, lib: str, torch):
    if lib == "dmlkit":
        if spec.kind == "miner":
            from dmlkit.miners import get_miner

            return get_miner(spec.name, **spec.dml_kwargs)
        from dmlkit.losses import get_loss

        kw = dict(spec.dml_kwargs)
        if spec.kind == "proxy":
            kw.update(num_classes=PROXY_CLASSES, embedding_size=EMBEDDING_SIZE)
        return get_loss(spec.name, **kw)
    import pytorch_metric_learning as pml
    import pytorch_metric_learning.distances
    import pytorch_metric_learning.losses
    import pytorch_metric_learning.miners
    import pytorch_metric_learning.regularizers

    kw = spec.pml_kwargs(pml)
    if spec.kind == "proxy":
        kw.update(num_classes=PROXY_CLASSES, embedding_size=EMBEDDING_SIZE)
    module = pml.miners if spec.kind == "miner" else pml.losses
    return getattr(module, spec.pml_class)(**kw)


def _init_weights(module, torch) -> None:
    """Give every 2-D weight the same seeded values on both sides ((C, D) or its transpose)."""
    for p in module.parameters():
        if p.dim() != 2:
            continue
        rows, cols = (p.shape[1], p.shape[0]) if p.shape[0] == EMBEDDING_SIZE else tuple(p.shape)
        g = torch.Generator().manual_seed(123)
        w = torch.randn(rows, cols, generator=g)
        with torch.no_grad():
            p.copy_(w.T if p.shape[0] == EMBEDDING_SIZE else w)


def _inputs(spec: Spec, batch: int, torch, dtype):
    g = torch.Generator().manual_seed(0)
    # L2-normalised, as a model's output in the Reality Check protocol
    emb = torch.nn.functional.normalize(torch.randn(batch, EMBEDDING_SIZE, generator=g), dim=1)
    emb = emb.to(dtype)
    labels = torch.arange(batch) // SAMPLES_PER_CLASS
    if spec.kind == "proxy":
        labels = labels % PROXY_CLASSES
    probe = torch.randn(batch, EMBEDDING_SIZE, generator=g).to(dtype)
    return emb, labels, probe


def _step(fn, spec: Spec, emb, labels, torch):
    if spec.kind == "miner":
        out = fn(emb, labels)
        return None, sum(int(t.numel()) for t in out)
    e = emb.clone().requires_grad_(True)
    loss = fn(e, labels)
    loss.backward()
    for p in fn.parameters():
        p.grad = None
    return e, float(loss.detach())


def worker(spec_key: str, lib: str, batches: list[int], repeats: int, threads: int,
           cap_gb: float, time_budget: float) -> None:
    import torch

    torch.set_num_threads(threads)
    spec = next(s for s in SPECS if s.key == spec_key)
    fn = _build(spec, lib, torch)
    _init_weights(fn, torch)
    _cap_memory(cap_gb)
    for batch in batches:
        result: dict[str, Any] = {"key": spec.key, "lib": lib, "batch": batch}
        try:
            emb, labels, probe = _inputs(spec, batch, torch, torch.float32)
            rss0 = _reset_peak()
            t0 = time.perf_counter()
            _step(fn, spec, emb, labels, torch)  # warm-up (counts for the peak)
            first = time.perf_counter() - t0
            times = [first] if first > time_budget else []  # too slow to repeat
            start = time.perf_counter()
            while not times or (
                len(times) < repeats and time.perf_counter() - start < time_budget
            ):
                t0 = time.perf_counter()
                _step(fn, spec, emb, labels, torch)
                times.append(time.perf_counter() - t0)
            result.update(status="ok", time_s=statistics.median(times), n=len(times),
                          peak_bytes=_peak_since(rss0))
            del emb, probe
            if batch <= CHECK_MAX_BATCH:
                emb64, labels, probe64 = _inputs(spec, batch, torch, torch.float64)
                fn64 = fn.double() if isinstance(fn, torch.nn.Module) else fn
                grad, value = _step(fn64, spec, emb64, labels, torch)
                result["value"] = value
                if grad is not None:
                    result["grad_probe"] = float((grad.grad * probe64).sum())
                fn.float()
        except (RuntimeError, MemoryError) as exc:
            msg = str(exc)
            oom = isinstance(exc, MemoryError) or "alloc" in msg.lower() or "memory" in msg.lower()
            result.update(status="oom" if oom else "error", error=msg.splitlines()[0][:200])
            fn.float()
        except Exception as exc:  # report, keep going with the next size
            result.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        print(json.dumps(result), flush=True)


def interleaved_worker(spec_key: str, batches: list[int], repeats: int, threads: int,
                       device: str = "cpu") -> None:
    """Both libraries in this one process, their steps alternating (dmlkit, pml, dmlkit, ...):
    on a shared machine a burst of load then hits both, so the ratio of the medians is far
    steadier than that of two separate processes. Time only (no memory: one process)."""
    import torch

    torch.set_num_threads(threads)
    spec = next(s for s in SPECS if s.key == spec_key)
    dev = torch.device(device)
    fns = {lib: _build(spec, lib, torch) for lib in ("dmlkit", "pml")}
    for fn in fns.values():
        _init_weights(fn, torch)
        if isinstance(fn, torch.nn.Module):
            fn.to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for batch in batches:
        emb, labels, _ = _inputs(spec, batch, torch, torch.float32)
        emb, labels = emb.to(dev), labels.to(dev)
        times: dict[str, list[float]] = {lib: [] for lib in fns}
        for fn in fns.values():  # warm-up
            _step(fn, spec, emb, labels, torch)
        for _ in range(repeats):
            for lib, fn in fns.items():
                sync()
                t0 = time.perf_counter()
                _step(fn, spec, emb, labels, torch)
                sync()
                times[lib].append(time.perf_counter() - t0)
        med = {lib: statistics.median(t) for lib, t in times.items()}
        low = {lib: min(t) for lib, t in times.items()}
        print(json.dumps({"key": spec.key, "batch": batch, "n": repeats, "dmlkit_s": med["dmlkit"],
                          "pml_s": med["pml"], "ratio": med["dmlkit"] / med["pml"],
                          "min_ratio": low["dmlkit"] / low["pml"]}), flush=True)


def _failure_line(proc: subprocess.CompletedProcess) -> str:
    """Why a worker failed, in one table cell: its last stderr line, or the signal that killed it
    (a worker killed for memory prints nothing)."""
    last = proc.stderr.strip().splitlines()[-1:] if proc.stderr else []
    if last:
        return last[0][:80]
    if proc.returncode < 0:
        return f"killed by signal {-proc.returncode} (out of memory?)"
    return f"exit status {proc.returncode}, no message"


def run_interleaved(specs: list[Spec], args) -> str:
    """``--interleaved``: one subprocess per spec running :func:`interleaved_worker`."""
    import torch

    lines = [f"Interleaved timing (`--interleaved`): forward + backward (miners: forward), "
             f"median of {args.repeats} alternating steps per library in one process, torch {torch.__version__}, "
             f"{args.threads} thread(s), device {args.device}, load average before the run "
             f"{os.getloadavg()[0]:.1f}.", "",
             "| loss | B | dmlkit median | pml median | ratio of medians | ratio of minima |",
             "|---|---|---|---|---|---|"]
    for s in specs:
        cmd = [sys.executable, __file__, "--interleaved-worker", s.key, "--batch-sizes",
               ",".join(map(str, args.batch_sizes)), "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--device", args.device]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=args.process_timeout)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                row = (f"| {r['key']} | {r['batch']} | {r['dmlkit_s'] * 1e3:.2f} ms | "
                       f"{r['pml_s'] * 1e3:.2f} ms | {r['ratio']:.2f} | {r['min_ratio']:.2f} |")
                print(row, flush=True)
                lines.append(row)
        if proc.returncode:
            lines.append(f"| {s.key} | - | failed: {_failure_line(proc)} | | | |")
            print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------
def _run_worker(spec: Spec, lib: str, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", spec.key, "--lib", lib,
           "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--repeats", str(args.repeats),
           "--threads", str(args.threads), "--mem-cap-gb", str(args.mem_cap_gb),
           "--time-budget", str(args.time_budget)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.process_timeout,
                              env=env, cwd=REPO)
        out, err, timed_out = proc.stdout, proc.stderr, False
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, timed_out = "", True
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    done = {r["batch"] for r in rows}
    for b in args.batch_sizes:
        if b not in done:
            status = "timeout" if timed_out else "crash"
            tail = err.strip().splitlines()[-1][:200] if err.strip() else ""
            rows.append({"key": spec.key, "lib": lib, "batch": b, "status": status, "error": tail})
    return rows


def _fmt_time(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return r["status"].upper()
    t = r["time_s"]
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


def _fmt_mem(r: dict | None) -> str:
    if r is None or r["status"] != "ok":
        return "-"
    mb = r["peak_bytes"] / 2**20
    return f"{mb:.1f} MB" if mb < 1024 else f"{mb / 1024:.2f} GB"


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or a["status"] != "ok" or b["status"] != "ok" or not b.get(key):
        return "-"
    return f"{a[key] / b[key]:.2f}"


def _agree(a: dict | None, b: dict | None) -> str:
    """``yes`` when the float64 value and gradient probe agree within TOLERANCE (relative)."""
    if not a or not b or "value" not in a or "value" not in b:
        return "-"

    def close(key: str) -> tuple[bool, float]:
        if key not in a or key not in b:
            return True, 0.0
        diff = abs(a[key] - b[key]) / max(1.0, abs(b[key]))
        return diff <= TOLERANCE, diff

    value_ok, value_diff = close("value")
    grad_ok, grad_diff = close("grad_probe")
    if value_ok and grad_ok:
        return f"yes ({max(value_diff, grad_diff):.0e})"
    if value_ok:
        return f"value yes, grad NO ({grad_diff:.0e})"
    return f"NO ({value_diff:.0e})"


def _call(spec: Spec, lib: str) -> str:
    if lib == "dmlkit":
        fn = "get_miner" if spec.kind == "miner" else "get_loss"
        kw = dict(spec.dml_kwargs)
        args = [repr(spec.name)] + [f"{k}={v!r}" for k, v in kw.items()]
        return f"`{fn}({', '.join(args)})`"
    try:
        import pytorch_metric_learning as pml
        import pytorch_metric_learning.distances
        import pytorch_metric_learning.regularizers

        kw = spec.pml_kwargs(pml)
    except ImportError:  # pragma: no cover
        kw = {}
    args = [f"{k}={(f'{v:.4g}' if isinstance(v, float) else type(v).__name__ + '()' if hasattr(v, '__dict__') else repr(v))}"
            for k, v in kw.items()]
    module = "miners" if spec.kind == "miner" else "losses"
    return f"`{module}.{spec.pml_class}({', '.join(args)})`"


def render(results: list[dict], args, specs: list[Spec], elapsed: float) -> str:
    import torch

    try:
        import pytorch_metric_learning as pml

        pml_version = pml.__version__
    except ImportError:  # pragma: no cover
        pml_version = "not installed"
    by = {(r["key"], r["lib"], r["batch"]): r for r in results}
    lines = [
        "# Loss and miner benchmark: dmlkit vs pytorch-metric-learning",
        "",
        f"Command: `python benchmarks/bench_losses.py {' '.join(args.argv)}`".rstrip() + "  ",
        f"Machine: 2-core CPU, 24 GB, shared with other jobs (load was not controlled; "
        f"{platform.processor() or platform.machine()}), torch {torch.__version__} with "
        f"{args.threads} thread(s), pytorch-metric-learning {pml_version}, Python "
        f"{platform.python_version()}. Total wall time {elapsed / 60:.1f} min.",
        "",
        f"Forward + backward of one step, embeddings {EMBEDDING_SIZE}-d float32, batches of "
        f"B/{SAMPLES_PER_CLASS} classes x {SAMPLES_PER_CLASS}; proxy losses {PROXY_CLASSES} "
        f"classes. Time = median over up to {args.repeats} steps after a warm-up "
        f"(fewer when the steps exceed {args.time_budget:g} s); close calls at B = 256/1024 "
        "(dmlkit > 0.9x pml) are measured again in reverse order and the faster median of "
        "each library is kept. Memory = peak extra RSS of the "
        "step in a fresh process per (loss, library), reset between batch sizes. `OOM` = needed "
        f"more than the {args.mem_cap_gb:g} GB address-space cap; `TIMEOUT` = over "
        f"{args.process_timeout} s. Ratios are dmlkit / pml (below 1 = dmlkit faster/smaller). "
        f"`agree` = float64 loss value and gradient probe `sum(grad * P)` equal within "
        f"{TOLERANCE:g} (relative, worst shown) at B <= {CHECK_MAX_BATCH}; miners: same number "
        "of mined pairs/triplets; `n/e` = not equivalent by design (see notes).",
        "",
    ]
    for b in args.batch_sizes:
        lines += [f"## B = {b}", "",
                  "| loss | dmlkit time | pml time | time ratio | dmlkit mem | pml mem | mem ratio | agree |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in specs:
            d, p = by.get((s.key, "dmlkit", b)), by.get((s.key, "pml", b))
            agree = _agree(d, p) if b <= CHECK_MAX_BATCH else ""
            if not s.equivalent and agree:
                agree = "n/e"
            if s.kind == "miner" and agree and agree != "-":
                agree = ("yes" if d.get("value") == p.get("value") else "count differs")
            lines.append(
                f"| {s.key} | {_fmt_time(d)} | {_fmt_time(p)} | {_ratio(d, p, 'time_s')} | "
                f"{_fmt_mem(d)} | {_fmt_mem(p)} | {_ratio(d, p, 'peak_bytes')} | {agree} |"
            )
        lines.append("")
    # targets
    misses = []
    for s in specs:
        if s.kind == "miner":
            continue
        for b in (256, 1024):
            d, p = by.get((s.key, "dmlkit", b)), by.get((s.key, "pml", b))
            if d and p and d["status"] == "ok" and p["status"] == "ok" and d["time_s"] > p["time_s"]:
                misses.append(f"{s.key} at B={b}: {d['time_s'] / p['time_s']:.2f}x pml")
    big = max(args.batch_sizes)
    failed_big = [s.key for s in specs if (r := by.get((s.key, "dmlkit", big))) and r["status"] != "ok"]
    measured = [b for b in (256, 1024) if b in args.batch_sizes]
    verdict = ("not measured in this run." if not measured else "met by every loss."
               if not misses else "missed by " + "; ".join(misses) + ".")
    lines += ["## Targets", "",
              "* Not slower than pml at B = 256 and 1024: " + verdict,
              f"* Every dmlkit loss and miner runs at B = {big}: "
              + ("yes." if not failed_big else "no: " + ", ".join(failed_big) + "."),
              "", "## Settings compared (dmlkit call = pml call)", "",
              "| row | dmlkit | pytorch-metric-learning | equivalent | note |", "|---|---|---|---|---|"]
    for s in specs:
        lines.append(f"| {s.key} | {_call(s, 'dmlkit')} | {_call(s, 'pml')} | "
                     f"{'yes' if s.equivalent else 'no'} | {s.note} |")
    lines += ["", "Proxy losses: both sides get the same seeded weights (pml's `W` = dmlkit's "
              "`weight.T`; SoftTriple `fc` = `centers.T`). Miners use cosine similarity on both sides."]
    errors = [r for r in results if r["status"] not in ("ok",) and r.get("error")]
    if errors:
        lines += ["", "Failures (first line of the error):", ""]
        lines += [f"* {r['key']} / {r['lib']} / B={r['batch']}: {r['status']}: `{r['error']}`" for r in errors]
    return "\n".join(lines) + "\n"


def _confirm(results: list[dict], specs: list[Spec], args) -> list[dict]:
    """Re-measure close calls (time ratio > 0.9 at B = 256 or 1024) in reverse order (pml
    first) and keep, per library, the faster of the two medians: the machine is shared, so a
    burst of load during one process should not decide the comparison."""
    by = {(r["key"], r["lib"], r["batch"]): r for r in results}
    for s in specs:
        sizes = [b for b in (256, 1024) if b in args.batch_sizes
                 and (d := by.get((s.key, "dmlkit", b))) and (p := by.get((s.key, "pml", b)))
                 and d["status"] == p["status"] == "ok" and d["time_s"] > 0.9 * p["time_s"]]
        if not sizes:
            continue
        for lib in ("pml", "dmlkit"):
            run_args = argparse.Namespace(**vars(args))
            run_args.batch_sizes = sizes
            for r in _run_worker(s, lib, run_args):
                old = by[(s.key, lib, r["batch"])]
                print(f"confirm {s.key:24s} {lib:6s} B={r['batch']:5d} {_fmt_time(old):>10s} -> "
                      f"{_fmt_time(r):>10s}", flush=True)
                if r["status"] == "ok" and r["time_s"] < old["time_s"]:
                    old["time_s"] = r["time_s"]
                old["rounds"] = 2
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="32,256,1024,4096")
    ap.add_argument("--only", default="", help="comma-separated spec keys (default: all)")
    ap.add_argument("--skip-pml-at", default="", help="batch sizes where pml is not run")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mem-cap-gb", type=float, default=6.0)
    ap.add_argument("--time-budget", type=float, default=5.0)
    ap.add_argument("--process-timeout", type=int, default=600)
    ap.add_argument("--no-confirm", dest="confirm", action="store_false",
                    help="do not re-measure close calls at B = 256/1024")
    ap.add_argument("--markdown", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--interleaved", action="store_true",
                    help="time only: both libraries alternating in one process per loss")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda with --interleaved")
    ap.add_argument("--interleaved-worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--lib", default="dmlkit", help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(raw)
    args.argv = [a for a in raw]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.threads = min(args.threads, 2)
    if args.worker:
        worker(args.worker, args.lib, args.batch_sizes, args.repeats, args.threads,
               args.mem_cap_gb, args.time_budget)
        return
    if args.interleaved_worker:
        interleaved_worker(args.interleaved_worker, args.batch_sizes, args.repeats, args.threads,
                           args.device)
        return
    if args.device != "cpu" and not args.interleaved:
        ap.error("--device cuda times with --interleaved (the default mode measures resident CPU memory)")

    sys.path.insert(0, str(REPO / "src"))
    from dmlkit.losses import LOSSES
    from dmlkit.miners import MINERS

    wanted = {k for k in args.only.split(",") if k}
    specs = [s for s in SPECS if not wanted or s.key in wanted]
    present = [s for s in specs if s.name in (MINERS if s.kind == "miner" else LOSSES)]
    for s in specs:
        if s not in present:
            print(f"skip {s.key}: dmlkit has no {s.kind} named {s.name!r} yet", flush=True)
    if args.interleaved:
        text = run_interleaved(present, args)
        if args.markdown:
            Path(args.markdown).write_text(text)
        return
    skip_pml = {int(b) for b in args.skip_pml_at.split(",") if b}
    results: list[dict] = []
    t_start = time.perf_counter()
    for s in present:
        for lib in ("dmlkit", "pml"):
            run_args = argparse.Namespace(**vars(args))
            if lib == "pml":
                run_args.batch_sizes = [b for b in args.batch_sizes if b not in skip_pml]
            if not run_args.batch_sizes:
                continue
            rows = _run_worker(s, lib, run_args)
            results += rows
            for r in rows:
                print(f"{s.key:32s} {lib:6s} B={r['batch']:5d} {_fmt_time(r):>10s} {_fmt_mem(r):>10s}"
                      + (f"  value={r['value']:.8g}" if "value" in r else "")
                      + (f"  [{r.get('error', '')[:80]}]" if r["status"] != "ok" else ""), flush=True)
    if args.confirm:
        results = _confirm(results, present, args)
    text = render(results, args, present, time.perf_counter() - t_start)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
