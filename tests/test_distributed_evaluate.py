"""`dmlkit evaluate` under torchrun: 2 gloo processes split the queries and give one process's
numbers, rank 0 alone prints, and a bad argument is one error line for the job.

The real CLI runs under ``python -m torch.distributed.run --nproc-per-node 2`` (one launch for
the successful cases, one for a refused one). The data are clustered float32 embeddings with
an exact duplicate pair and string class names, so that near-ties and label encoding are
exercised; the reference numbers come from the same CLI in this process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dmlkit.cli import main
from dmlkit.distributed import context
from dmlkit.embedding_shards import write_shards
from dmlkit.metrics import evaluate_streaming

pytestmark = pytest.mark.usefixtures("one_thread")

#: Mixed metrics: split by query (P@1, Recall@K, R-Precision, MAP@R) and on rank 0 (map, nmi).
MIXED = "precision_at_1,recall_at_k,r_precision,map_at_r,map,nmi"

#: Each CLI call's JSON, written by rank 0 between marker lines.
DRIVER = """
import os, sys
from dmlkit.cli import main
for i, args in enumerate([a.split("|") for a in sys.argv[1:]]):
    if os.environ["RANK"] == "0":
        print(f"=== {i}", flush=True)
    main(args)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp: Path, *calls: list[str]) -> subprocess.CompletedProcess:
    script = tmp / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), str(script), *("|".join(c) for c in calls)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp)


def _one_process(args: list[str], capsys) -> dict:
    capsys.readouterr()
    main(args)
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dist_eval")
    rng = np.random.default_rng(0)
    n, d, c = 601, 16, 25
    y = rng.integers(0, c, n)
    x = (rng.normal(size=(c, d))[y] + 1.2 * rng.normal(size=(n, d))).astype(np.float32)
    x[5] = x[7]  # an exact duplicate: a tie the split must not reorder
    names = np.array([f"class-{v:02d}" for v in y])
    np.savez(tmp / "e.npz", embeddings=x, labels=names)
    np.savez(tmp / "r.npz", embeddings=x[:200], labels=names[:200])
    write_shards(tmp / "shards", x, y, shard_rows=128)
    return tmp


CALLS = [
    ["evaluate", "e.npz", "--json", "-m", MIXED],
    ["evaluate", "e.npz", "-r", "r.npz", "--json", "-m", "precision_at_1,map_at_r,recall_at_k",
     "--k", "1,5"],
    ["evaluate", "shards", "--json", "--memory-mb", "1"],
]


@pytest.fixture(scope="module")
def two_ranks(data) -> tuple[subprocess.CompletedProcess, list[dict]]:
    proc = _torchrun(data, *CALLS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = proc.stdout.split("=== ")[1:]
    return proc, [json.loads(part.split("\n", 1)[1]) for part in outputs]


@pytest.mark.parametrize("call", range(len(CALLS)))
def test_two_ranks_give_one_process_s_numbers(data, two_ranks, call, capsys, monkeypatch):
    monkeypatch.chdir(data)
    want = _one_process(CALLS[call], capsys)
    got = two_ranks[1][call]
    assert got == want  # every value to the last bit, and the same keys in the same order
    assert list(got) == list(want)


def test_rank_zero_alone_prints(two_ranks):
    proc, outputs = two_ranks
    assert len(outputs) == len(CALLS)  # one marker and one JSON object per call, not two
    assert proc.stdout.count('"num_queries":') == len(CALLS)


def test_a_refused_argument_is_one_line_for_the_job(data):
    proc = _torchrun(data, ["evaluate", "e.npz", "--device", "cuda"])
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert lines == ["error: --device: under torchrun each rank evaluates its share of the queries "
                     "on the CPU; for a GPU run one process with --device cuda"]


def test_without_a_process_group_it_is_the_streaming_evaluation(data):
    assert not context().enabled
    with np.load(data / "e.npz") as f:
        x, y = f["embeddings"], f["labels"]
    assert evaluate_streaming(x, y, block_rows=100, across_ranks=True) == evaluate_streaming(x, y, block_rows=100)
