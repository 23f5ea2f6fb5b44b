"""EmbeddingIndex (flat / IVF-Flat / IVF-PQ / HNSW) vs calling faiss directly, and the service under load.

Data: clustered unit vectors (``C = N / 50`` class centres ~ N(0, I_d), each sample = its centre +
``sigma`` N(0, I_d), L2-normalised; sigma = 1.7 as in bench_metrics.py: overlapping classes, so
the neighbours are not trivially one cell), plus ``--queries`` held-out queries from the same centres.
For every kind, dmlkit builds the index with ``target_recall`` (default 0.95 recall@10, tuned on
1,000 indexed rows held out from the quantiser's training) and then, on the held-out queries:

* recall@10 against exact search (``dmlkit.metrics.knn``);
* single-query latency (p50 / p99 over ``--single`` queries, one ``search`` call each);
* batch throughput (batch calls of 100 queries, queries per second);

and the same three numbers for faiss called directly on the *same* trained faiss structure with
the same settings (``index.search(x, k, params=...)``; IVF-PQ: ``faiss.IndexRefineFlat`` with
the same ``k_factor``; flat: ``faiss.IndexFlatIP``), so the ratio is dmlkit's overhead. The two
sides are interleaved (query by query, alternating order; batch calls chunk by chunk,
alternating, 3 repeats) so both see the same load; ``ovh 1q`` is the median over queries of
dmlkit's / faiss's time - 1, ``ovh QPS`` the median over batch chunks of dmlkit's / faiss's time
- 1 (the JSON also holds ``overhead_batch_best_qps``, from each side's best total). Build time (including the recall tuning) and
memory (faiss structure + the float32 vectors dmlkit keeps) are reported too.

``--service`` also starts ``dmlkit serve``'s app on 127.0.0.1 over an HNSW index and measures
p50/p99 latency and throughput of ``--service-requests`` embedding queries from
``--service-clients`` concurrent keep-alive clients.

    python benchmarks/bench_index.py                       # N = 200k, d = 128
    python benchmarks/bench_index.py --n 1000000 --kinds ivf_flat hnsw
    python benchmarks/bench_index.py --n 50000 --service   # quick, with the service load test

Writes every measurement as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np


def make_data(n: int, q: int, d: int, sigma: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    classes = max(1, n // 50)
    centres = rng.standard_normal((classes, d), dtype=np.float32)

    def draw(m: int) -> np.ndarray:
        lab = rng.integers(0, classes, m)
        x = centres[lab] + np.float32(sigma) * rng.standard_normal((m, d), dtype=np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    return draw(n).astype(np.float32), draw(q).astype(np.float32)


def _interleaved_latencies(fns, queries: np.ndarray, count: int) -> list[np.ndarray]:
    """Single-query latencies (ms) of each function, interleaved query by query (order alternating),
    so that every side sees the same machine load."""
    out: list[list[float]] = [[] for _ in fns]
    for i in range(min(count, len(queries))):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            t0 = time.perf_counter()
            fns[j](queries[i:i + 1])
            out[j].append(time.perf_counter() - t0)
    return [np.asarray(v) * 1000 for v in out]


def _interleaved_throughput(fns, queries: np.ndarray, repeats: int = 3, chunk: int = 100) -> tuple[list[float], float]:
    """``(QPS per side, median chunk ratio)`` of batch calls of ``chunk`` queries.

    The sides alternate chunk by chunk (order reversed every other chunk), so that a load that
    changes during the measurement (a 1M-row IVF batch runs for minutes) falls on both alike;
    QPS is each side's best repeat over all chunks, the ratio the median over every chunk of the
    first side's time / the second side's."""
    times = np.zeros((repeats, len(fns)))
    ratios = []
    starts = list(range(0, len(queries), chunk))
    for r in range(repeats):
        for i, a in enumerate(starts):
            part = queries[a:a + chunk]
            order = range(len(fns)) if (i + r) % 2 == 0 else reversed(range(len(fns)))
            took = [0.0] * len(fns)
            for j in order:
                t0 = time.perf_counter()
                fns[j](part)
                took[j] = time.perf_counter() - t0
            times[r] += took
            ratios.append(took[0] / took[1])
    return [len(queries) / float(times[:, j].min()) for j in range(len(fns))], float(np.median(ratios))


def _faiss_direct(idx, kind: str):
    """A function ``queries -> keys`` calling faiss on the same structure with the same settings."""
    import faiss

    k = 10
    if kind == "flat":
        flat = faiss.IndexFlatIP(idx.dim)
        flat.add(idx.embeddings)
        return lambda q: flat.search(q, k)[1]
    index = idx._faiss_index
    if kind == "hnsw":
        params = faiss.SearchParametersHNSW(efSearch=int(idx.params["ef_search"]))
        return lambda q: index.search(q, k, params=params)[1]
    ivf = faiss.SearchParametersIVF(nprobe=int(idx.params["nprobe"]))
    if kind == "ivf_flat":
        return lambda q: index.search(q, k, params=ivf)[1]
    refine = faiss.IndexRefineFlat(index, faiss.swig_ptr(np.ascontiguousarray(idx.embeddings)))
    params = faiss.IndexRefineSearchParameters(k_factor=float(idx.params["rerank"]), base_index_params=ivf)
    keep = (index, ivf)  # the refine index and the parameters point into these

    def search(q: np.ndarray, _keep=keep) -> np.ndarray:
        return refine.search(q, k, params=params)[1]

    return search


def _set_threads(n: int) -> None:
    import faiss
    import torch
    from threadpoolctl import threadpool_limits

    faiss.omp_set_num_threads(n)
    torch.set_num_threads(n)
    threadpool_limits(n)  # numpy's BLAS too (stays set for the process)


def bench_kind(kind: str, x: np.ndarray, queries: np.ndarray, exact: np.ndarray, args):
    """``(figures, index)`` of one index kind: build (add, then tuning), recall, latency, QPS."""
    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.index import recall_at_k

    _set_threads(args.build_threads)
    settings = ({"nlist": args.nlist} if kind.startswith("ivf") else
                {"ef_construction": args.ef_construction} if kind == "hnsw" else {})  # each kind's own
    idx = EmbeddingIndex(None, dim=x.shape[1], kind=kind, recall_queries=args.recall_queries, **settings)
    t0 = time.perf_counter()
    idx.add(x)  # the same path as EmbeddingIndex(x, ...): add (IVF: train first), then tune
    add_s = time.perf_counter() - t0
    tune_s = 0.0
    if kind != "flat":
        t0 = time.perf_counter()
        idx.tune(args.target_recall, k=10, num_queries=args.recall_queries)
        tune_s = time.perf_counter() - t0
    build = add_s + tune_s
    _set_threads(args.threads)
    tuned = {} if kind == "flat" else {k: v for k, v in idx.recall.items() if k not in ("tried",)}
    ours = lambda q: idx.search(q, 10)  # noqa: E731
    direct = _faiss_direct(idx, kind)
    # warm both
    ours(queries[:8])
    direct(queries[:8])
    fns = [ours, direct]
    lat = _interleaved_latencies(fns, queries, args.single)
    qps, batch_ratio = _interleaved_throughput(fns, queries)
    rows = {}
    for j, side in enumerate(("dmlkit", "faiss")):
        found = fns[j](queries)
        found = found.indices if hasattr(found, "indices") else found
        if side == "faiss" and kind != "flat":
            found = np.where(found >= 0, np.searchsorted(idx._keys, np.maximum(found, 0)), -1)
        rows[side] = {"recall_at_10": recall_at_k(found, exact, 10), "p50_ms": float(np.median(lat[j])),
                      "p99_ms": float(np.percentile(lat[j], 99)), "qps_batch": qps[j]}
    rows["median_ratio"] = float(np.median(lat[0] / lat[1]))
    return {
        "kind": kind, "n": len(x), "d": x.shape[1], "build_s": build, "add_s": add_s, "tune_s": tune_s,
        "tuned": tuned, "tried": [] if kind == "flat" else idx.recall["tried"],
        "settings": {k: v for k, v in idx.params.items() if v is not None},
        "faiss_bytes": idx.index_bytes(), "vector_bytes": int(idx.embeddings.nbytes),
        "dmlkit": rows["dmlkit"], "faiss": rows["faiss"],
        "overhead_p50": rows["median_ratio"] - 1,  # median over queries of dmlkit/faiss time
        "overhead_batch": batch_ratio - 1,
        "overhead_batch_best_qps": rows["faiss"]["qps_batch"] / rows["dmlkit"]["qps_batch"] - 1,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }, idx


def bench_bookkeeping(x: np.ndarray) -> float:
    """Seconds of dmlkit's own work in ``add`` (validation, ids, keys) on a flat index: no faiss."""
    from dmlkit.apps import EmbeddingIndex

    t0 = time.perf_counter()
    EmbeddingIndex(None, dim=x.shape[1]).add(x)
    return time.perf_counter() - t0


OVERHEAD_SETTINGS = {"flat": {}, "ivf_flat": {"nprobe": 16}, "ivf_pq": {"nprobe": 16, "rerank": 4},
                     "hnsw": {"ef_search": 64}}


def bench_overhead(kind: str, x: np.ndarray, queries: np.ndarray, count: int) -> dict:
    """dmlkit's fixed cost per single query at small, fixed settings, and where it goes (µs, medians).

    ``search`` vs faiss direct interleaved query by query (median of the per-query difference),
    then each step of ``search`` timed alone over the same queries: input check, query
    normalisation, the faiss call, keys to rows, the rest of ``_ann`` (IVF-PQ: re-ranking) and
    the result packaging (``search`` minus ``_ann`` minus the input check).
    """
    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.index_exact import to_numpy_embeddings

    idx = EmbeddingIndex(x, kind=kind, recall_queries=50, **OVERHEAD_SETTINGS[kind])
    ours = lambda q: idx.search(q, 10)  # noqa: E731
    direct = _faiss_direct(idx, kind)
    one = [np.ascontiguousarray(queries[i:i + 1]) for i in range(min(count, len(queries)))]
    for q in one[:20]:
        ours(q)
        direct(q)
    lat = _interleaved_latencies([ours, direct], np.concatenate(one), len(one))
    out = {"kind": kind, "n": len(x), "settings": OVERHEAD_SETTINGS[kind],
           "dmlkit_us": float(np.median(lat[0]) * 1000), "faiss_us": float(np.median(lat[1]) * 1000),
           "overhead_us": float(np.median(lat[0] - lat[1]) * 1000)}

    def step(fn) -> float:
        times = []
        for q in one:
            t0 = time.perf_counter_ns()
            fn(q)
            times.append(time.perf_counter_ns() - t0)
        return float(np.median(times) / 1000)

    if kind == "flat":
        out["steps_us"] = {"input check": step(lambda q: to_numpy_embeddings(q, "q")),
                           "exact search (faiss scan + float64 order)": step(lambda q: idx._exact(q, 10)),
                           "search() total": step(ours)}
        return out
    setting = idx._setting()
    k_search = 10 * int(setting.get("rerank", 1))
    params = idx._search_params(setting)
    prepared = [idx._prepare(q) for q in one]
    keys = idx._faiss_index.search(prepared[0], k_search, params=params)[1]
    it = iter(range(10**9))
    faiss_s = step(lambda q: idx._faiss_index.search(prepared[next(it) % len(prepared)], k_search, params=params))
    ann = step(lambda q: idx._ann(q, 10, setting))
    check = step(lambda q: to_numpy_embeddings(q, "q"))
    prep = step(idx._prepare)
    rows = step(lambda q: idx._rows_of_keys(keys))
    total = step(ours)
    out["steps_us"] = {"input check": check, "normalise query": prep, "faiss search": faiss_s,
                       "keys to rows": rows, "rest of _ann (IVF-PQ: re-ranking)": ann - prep - faiss_s - rows,
                       "result packaging": total - ann - check, "search() total": total}
    return out


def bench_service(x: np.ndarray, queries: np.ndarray, args, idx=None) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.service import ServiceConfig, create_app, start_background_server

    if idx is None:
        idx = EmbeddingIndex(x, kind="hnsw", target_recall=args.target_recall, recall_queries=args.recall_queries)
    app = create_app(ServiceConfig(index="(in memory)"), index=idx)
    server, thread, url = start_background_server(app)
    bodies = [queries[i % len(queries)].tolist() for i in range(args.service_requests)]
    try:
        with httpx.Client(timeout=60) as http:
            http.post(f"{url}/api/query/embedding", json={"embedding": bodies[0], "k": 10})

            def one(i: int) -> tuple[float, int]:
                t0 = time.perf_counter()
                r = http.post(f"{url}/api/query/embedding", json={"embedding": bodies[i], "k": 10})
                return time.perf_counter() - t0, r.status_code

            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=args.service_clients) as pool:
                out = list(pool.map(one, range(args.service_requests)))
            wall = time.perf_counter() - t0
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    lat = np.asarray([t for t, _ in out]) * 1000
    return {"requests": len(out), "clients": args.service_clients, "ok": sum(s == 200 for _, s in out),
            "p50_ms": float(np.median(lat)), "p99_ms": float(np.percentile(lat, 99)),
            "throughput_rps": len(out) / wall, "index": "hnsw", "n": len(x),
            "setting": {"ef_search": idx.params["ef_search"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--single", type=int, default=300, help="queries timed one by one")
    ap.add_argument("--sigma", type=float, default=1.7, help="cluster spread (smaller: easier ANN)")
    ap.add_argument("--kinds", nargs="+", default=["flat", "ivf_flat", "ivf_pq", "hnsw"])
    ap.add_argument("--target-recall", type=float, default=0.95)
    ap.add_argument("--ef-construction", type=int, default=40, help="HNSW build beam (faiss's default 40)")
    ap.add_argument("--recall-queries", type=int, default=1000)
    ap.add_argument("--service", action="store_true", help="also run the service load test")
    ap.add_argument("--service-requests", type=int, default=2000)
    ap.add_argument("--service-clients", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="faiss/torch threads (1: no OpenMP spin-waiting on a shared, busy machine)")
    ap.add_argument("--nlist", type=int, default=None,
                    help="IVF cells (default: dmlkit's 4 sqrt(N); fewer cells train faster)")
    ap.add_argument("--build-threads", type=int, default=None,
                    help="threads while building and tuning (default: --threads); timings always use --threads")
    ap.add_argument("--overhead", action="store_true",
                    help="only dmlkit's fixed cost per query and its breakdown, at small fixed settings")
    ap.add_argument("--out", type=Path, default=Path("bench_index.json"))
    args = ap.parse_args(argv)
    args.build_threads = args.build_threads or args.threads

    os.environ["NUMBA_NUM_THREADS"] = str(args.threads)
    _set_threads(args.threads)

    from dmlkit.metrics import knn

    if args.overhead:
        x, queries = make_data(args.n, args.queries, args.d, args.sigma)
        rows = [bench_overhead(kind, x, queries, args.single) for kind in args.kinds]
        for r in rows:
            steps = ", ".join(f"{k} {v:.1f}" for k, v in r["steps_us"].items())
            print(f"{r['kind']:9} faiss {r['faiss_us']:8.1f} us  dmlkit {r['dmlkit_us']:8.1f} us  "
                  f"overhead {r['overhead_us']:+7.1f} us | {steps}", flush=True)
        args.out.write_text(json.dumps({"overhead": rows, "load": os.getloadavg()}, indent=2))
        return 0

    t0 = time.perf_counter()
    x, queries = make_data(args.n, args.queries, args.d, args.sigma)
    exact = knn(queries, x, k=10, distance="cosine", exclude_self=False).indices.numpy()
    print(f"data N={args.n} d={args.d}, {args.queries} held-out queries; exact top-10 in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    results = {"n": args.n, "d": args.d, "threads": args.threads, "build_threads": args.build_threads,
               "cpu": os.cpu_count(), "load_before": os.getloadavg(), "kinds": [],
               "bookkeeping_add_s": bench_bookkeeping(x)}
    print(f"dmlkit's own work in add (validation, ids, keys; no faiss): {results['bookkeeping_add_s']:.1f} s")
    header = (f"{'kind':9} {'build s':>8} {'MiB':>7} {'setting':>22} {'recall':>7} "
              f"{'p50 ms':>7} {'p99 ms':>7} {'QPS':>8} | {'faiss p50':>9} {'faiss QPS':>9} {'ovh 1q':>8} {'ovh QPS':>8}")
    print(header)
    hnsw = None
    for kind in args.kinds:
        r, idx = bench_kind(kind, x, queries, exact, args)
        r["load_after"] = os.getloadavg()
        hnsw = idx if kind == "hnsw" else hnsw
        del idx
        results["kinds"].append(r)
        args.out.write_text(json.dumps(results, indent=2))  # partial results survive an interrupted run
        setting = ",".join(f"{k}={v}" for k, v in (r["tuned"].get("setting") or {}).items()) or "exact"
        mib = (r["faiss_bytes"] + r["vector_bytes"]) / 2**20
        print(f"{kind:9} {r['build_s']:8.1f} {mib:7.0f} {setting:>22} {r['dmlkit']['recall_at_10']:7.4f} "
              f"{r['dmlkit']['p50_ms']:7.3f} {r['dmlkit']['p99_ms']:7.3f} {r['dmlkit']['qps_batch']:8.0f} | "
              f"{r['faiss']['p50_ms']:9.3f} {r['faiss']['qps_batch']:9.0f} {100 * r['overhead_p50']:7.1f}% "
              f"{100 * r['overhead_batch']:7.1f}%", flush=True)
    if args.service:
        s = bench_service(x, queries, args, hnsw)
        results["service"] = s
        print(f"service (hnsw, {s['clients']} clients, {s['requests']} requests): p50 {s['p50_ms']:.1f} ms, "
              f"p99 {s['p99_ms']:.1f} ms, {s['throughput_rps']:.0f} req/s, {s['ok']} OK")
    results["load_after"] = os.getloadavg()
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results["wall_s"] = time.perf_counter() - t0
    args.out.write_text(json.dumps(results, indent=2))
    print(f"peak RSS {results['peak_rss_mib']:.0f} MiB; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
