"""The ranks of one ``torchrun`` job must run one job: the same options, the same inputs.

``dmlkit evaluate`` under torchrun scored each rank's share of the queries against its own copy
of the files with its own options: ranks that read different copies, or were given another
``-d``, printed one confident result that mixed them (another ``-m`` list hung for the 10-minute
collective timeout). ``dmlkit embed`` wrote one ``.npz`` from two copies of the data, or from
two checkpoints. Both now compare what each rank holds and refuse a difference in one line.
Also: ``RANK`` outside ``[0, WORLD_SIZE)`` is one line before any rendezvous, a warning of
``dmlkit evaluate`` is printed once under torchrun, and the commands that run as one process
(``dmlkit bench`` ...) refuse ``WORLD_SIZE`` > 1.

The evaluate cases run the real CLI in one ``torchrun --nproc-per-node 2`` launch (the
driver gives rank 1 its own arguments); embed runs in 2 spawned gloo processes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from _reference import grey_image_folder, tiny_image_folder_config
from dmlkit.commands import _ranks
from dmlkit.distributed import DistributedError, init_distributed, raised_on_every_rank, shutdown
from dmlkit.embedding_shards import write_shards
from dmlkit.exceptions import DataError
from dmlkit.training import read_checkpoint, train
from dmlkit.training.checkpoint import save_checkpoint
from dmlkit.training.trainer import embed_run

pytestmark = pytest.mark.usefixtures("one_thread")

#: Runs each call's arguments for its rank (``{"0": [...], "1": [...]}``), rank 0 marking each
#: call on both streams; an error exit is reported and the next call runs in the same group.
DRIVER = """
import json, os, sys
from dmlkit.cli import main
rank = os.environ["RANK"]
for i, call in enumerate(json.load(open(sys.argv[1]))):
    if rank == "0":
        print(f"=== {i}", flush=True)
        print(f"=== {i}", file=sys.stderr, flush=True)
    try:
        main(call[rank])
    except SystemExit as exc:
        if rank == "0":
            print(f"exit {exc.code}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
"""

MIXED = "precision_at_1,map_at_r,map"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """``e.npz`` and an identical copy elsewhere, a stale copy (one row moved), a longer copy,
    a reference sharing 3 rows with ``q.npz``, two shard copies and a changed shard set."""
    tmp = tmp_path_factory.mktemp("same_job")
    rng = np.random.default_rng(0)
    n, d, c = 120, 8, 12
    y = rng.integers(0, c, n)
    x = (rng.normal(size=(c, d))[y] + rng.normal(size=(n, d))).astype(np.float32)
    np.savez(tmp / "e.npz", embeddings=x, labels=y)
    (tmp / "copy").mkdir()
    shutil.copy(tmp / "e.npz", tmp / "copy" / "e.npz")
    stale = x.copy()
    stale[3] += 0.5
    np.savez(tmp / "stale.npz", embeddings=stale, labels=y)
    np.savez(tmp / "more.npz", embeddings=np.concatenate([x, x[:6]]), labels=np.concatenate([y, y[:6]]))
    np.savez(tmp / "q.npz", embeddings=x[:20], labels=y[:20])
    np.savez(tmp / "r.npz", embeddings=np.concatenate([x[17:20], x[40:]]), labels=np.concatenate([y[17:20], y[40:]]))
    write_shards(tmp / "shards", x, y, shard_rows=50)
    shutil.copytree(tmp / "shards", tmp / "copy" / "shards")
    write_shards(tmp / "stale-shards", stale, y, shard_rows=50)
    return tmp


def _same(*args: str) -> dict[str, list[str]]:
    return {"0": ["evaluate", *args], "1": ["evaluate", *args]}


def _rank1(rank0: list[str], rank1: list[str]) -> dict[str, list[str]]:
    return {"0": ["evaluate", *rank0], "1": ["evaluate", *rank1]}


CALLS = [
    _rank1(["e.npz", "--json", "-m", MIXED], ["stale.npz", "--json", "-m", MIXED]),
    _rank1(["e.npz", "--json"], ["more.npz", "--json"]),
    _rank1(["e.npz", "--json", "-d", "cosine"], ["e.npz", "--json", "-d", "snr"]),
    _rank1(["e.npz", "--json", "-m", MIXED], ["e.npz", "--json", "-m", "precision_at_1,map_at_r"]),
    _rank1(["shards", "--json"], ["stale-shards", "--json"]),
    _rank1(["e.npz", "--json", "-m", MIXED], ["copy/e.npz", "--json", "-m", MIXED]),  # copies: accepted
    _rank1(["shards", "--json"], ["copy/shards", "--json"]),
    _same("q.npz", "-r", "r.npz", "--json", "-m", "map,map_at_r"),  # 3 shared rows: one warning
]


@pytest.fixture(scope="module")
def two_ranks(data) -> list[tuple[str, str]]:
    """``(stdout, stderr)`` of rank 0 for each of :data:`CALLS`, from one torchrun launch."""
    (data / "calls.json").write_text(json.dumps(CALLS))
    (data / "driver.py").write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DMLKIT_DIST_TIMEOUT": "30"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
         "127.0.0.1", "--master-port", str(_free_port()), "driver.py", "calls.json"],
        capture_output=True, text=True, env=env, timeout=300, cwd=data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs, errs = proc.stdout.split("=== ")[1:], proc.stderr.split("=== ")[1:]
    assert len(outs) == len(errs) == len(CALLS), proc.stderr[-3000:]
    return [(o.split("\n", 1)[1], e.split("\n", 1)[1]) for o, e in zip(outs, errs)]


def _one_process(data: Path, args: list[str], capsys, monkeypatch) -> dict:
    from dmlkit.cli import main

    monkeypatch.chdir(data)
    capsys.readouterr()
    main(args)
    return json.loads(capsys.readouterr().out)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


REFUSED = {
    0: "query embeddings: rank 0: 120 x 8 float32 (sha256 ",
    1: "query embeddings: rank 0: 120 x 8 float32 (sha256 ",
    2: "(--distance: rank 0: cosine, rank 1: snr)",
    3: "(-m: rank 0: precision_at_1,map_at_r,map, rank 1: precision_at_1,map_at_r)",
    4: "query embeddings: rank 0: 120 x 8 float32 (sha256 ",
}


@pytest.mark.parametrize("call", sorted(REFUSED))
def test_ranks_given_other_inputs_or_options_are_refused_in_one_line(two_ranks, call):
    out, err = two_ranks[call]
    assert out.strip() == "exit 2"  # no result printed
    lines = _errors(err)
    assert len(lines) == 1, err  # rank 0's line alone
    assert lines[0].startswith("error: the ranks were given different options or inputs ("), lines[0]
    assert REFUSED[call] in lines[0] and "identical copy of each file" in lines[0]


def test_what_differs_is_named_and_nothing_else(two_ranks):
    line = _errors(two_ranks[1][1])[0]  # 126 rows on rank 1: the embeddings and the labels
    assert "rank 1: 126 x 8 float32" in line and "query labels: rank 0: 120 int64" in line
    assert "--distance" not in line and "reference" not in line
    line = _errors(two_ranks[0][1])[0]  # one row changed: the same shape, another content
    assert "rank 1: 120 x 8 float32" in line and "query labels" not in line


@pytest.mark.parametrize("call", [5, 6])
def test_identical_copies_in_other_places_give_one_process_s_numbers(data, two_ranks, call, capsys,
                                                                     monkeypatch):
    out, err = two_ranks[call]
    assert not _errors(err), err
    assert json.loads(out) == _one_process(data, CALLS[call]["0"], capsys, monkeypatch)


def test_a_warning_is_printed_once_by_rank_0(data, two_ranks, capsys, monkeypatch):
    out, err = two_ranks[7]
    shared = [line for line in err.splitlines() if "also appear, identical" in line]
    assert len(shared) == 1, err
    assert shared[0].startswith("warning: 3 of the 20 query embeddings")
    assert json.loads(out) == _one_process(data, CALLS[7]["0"], capsys, monkeypatch)


# -- dmlkit embed ---------------------------------------------------------------------------------
EMBED_CONFIG = tiny_image_folder_config("same-embed", val_fraction=0.5)


def _embed_worker(rank: int, port: int, out_dir: str) -> None:
    """Embeds the test split three times: rank 1 with an identical copy of the run and the data
    in other places, with its own copy of the data (a test image changed), with another
    checkpoint; writes what each call gave to ``rank<r>.json``."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    out = Path(out_dir)
    init_distributed("cpu", timeout_s=120)
    cases = {"copies": ("run", "data"), "data": ("run", "changed"), "checkpoint": ("retrained", "data")}
    report = {}
    try:
        for case, (run1, data1) in cases.items():
            run, root = (out / "run", out / "data") if rank == 0 else (out / "copy" / run1, out / "copy" / data1)
            try:
                embed_run(run, "test", output=out / f"{case}.npz", data_root=root, device="cpu")
                report[case] = "embedded"
            except DataError as exc:
                report[case] = str(exc)
                report[f"{case} every rank"] = raised_on_every_rank(exc)
    finally:
        shutdown()
    (out / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.filterwarnings("ignore")
def test_embed_refuses_ranks_with_other_data_or_another_checkpoint(tmp_path):
    grey_image_folder(tmp_path / "data", classes=8)
    train(EMBED_CONFIG, tmp_path / "run", data_root=tmp_path / "data", progress=False)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "data", copy / "data")
    shutil.copytree(tmp_path / "data", copy / "changed")
    with open(copy / "changed" / "class06" / "1.png", "ab") as f:  # a test image (classes 4-7 test)
        f.write(b"\0")
    shutil.copytree(tmp_path / "run", copy / "run")
    shutil.copytree(tmp_path / "run", copy / "retrained")
    best = copy / "retrained" / "checkpoints" / "best.pt"
    payload = read_checkpoint(best)
    first = next(iter(payload["model"]))
    payload["model"][first] = payload["model"][first] + 0.01  # the same run, other weights
    save_checkpoint(payload, best)

    mp.spawn(_embed_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # each rank names the file it read (rank 0 prints the line)
    assert f"; rank 0 read {tmp_path / 'run' / 'checkpoints' / 'best.pt'}): " in r0["checkpoint"]
    assert f"; rank 1 read {best}): " in r1.pop("checkpoint")
    assert r0["copies"] == "embedded" and {k: v for k, v in r0.items() if k != "checkpoint"} == r1
    one = embed_run(tmp_path / "run", "test", output=tmp_path / "one.npz", data_root=tmp_path / "data",
                    device="cpu")
    with np.load(tmp_path / "copies.npz") as two:
        np.testing.assert_array_equal(two["labels"], one[2])
        np.testing.assert_allclose(two["embeddings"], one[1], rtol=1e-5, atol=1e-6)
    assert r0["data"].startswith("the ranks loaded different data (test split: rank 0: 16 samples of "
                                 "4 classes (digest "), r0["data"]
    assert r0["checkpoint"].startswith("the ranks loaded different checkpoints (rank 0: sha256 "), r0["checkpoint"]
    assert "rank 1: sha256 " in r0["checkpoint"] and "identical copy of the checkpoint" in r0["checkpoint"]
    assert r0["data every rank"] and r0["checkpoint every rank"]  # printed once, by rank 0
    assert not (tmp_path / "data.npz").exists() and not (tmp_path / "checkpoint.npz").exists()


# -- the environment ------------------------------------------------------------------------------
@pytest.mark.parametrize(("variables", "message"), [
    ({"RANK": "2"}, "RANK=2 is outside 0..1 (WORLD_SIZE=2): each process of the job needs its own RANK"),
    ({"RANK": "-1"}, "RANK=-1 is outside 0..1 (WORLD_SIZE=2)"),
    ({"RANK": "abc"}, "RANK='abc' is not an integer"),
    ({"RANK": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is outside 0..1 (LOCAL_WORLD_SIZE=2)"),
])
def test_a_rank_outside_the_world_is_one_line_before_any_rendezvous(monkeypatch, variables, message):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))  # nobody listens: a rendezvous would wait
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedError) as caught:
        init_distributed("cpu", timeout_s=3)
    assert str(caught.value).startswith(message), str(caught.value)


def test_the_cli_prints_the_rank_line_once(monkeypatch, run_cli, tmp_path):
    for name, value in {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DMLKIT_DIST_TIMEOUT", "3")
    monkeypatch.setattr(_ranks, "UNJOINED_DELAY_S", 0.0)
    np.savez(tmp_path / "e.npz", embeddings=np.eye(4, dtype=np.float32), labels=[0, 0, 1, 1])
    code, out, err = run_cli(["evaluate", str(tmp_path / "e.npz"), "--json"])
    assert code == 2 and not out
    assert err.splitlines() == ["error: RANK=2 is outside 0..1 (WORLD_SIZE=2): each process of the job needs "
                                "its own RANK from 0 to WORLD_SIZE - 1 (torchrun sets them: start the job "
                                "with `torchrun --nproc-per-node N dmlkit ...`)"]


@pytest.mark.parametrize("argv", [["bench", "bench.yaml", "--out", "b"], ["report", "runs/x"],
                                  ["compare", "a.npz", "b.npz"], ["index", "e.npz", "-o", "idx"]])
def test_one_process_commands_refuse_a_torchrun_start(monkeypatch, run_cli, tmp_path, argv):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, out, err = run_cli(argv)
    assert code == 2 and not out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: `dmlkit {argv[0]}` runs as one process, and this one "
                                                   "was started as one of WORLD_SIZE=2 (torchrun)"), err
    assert lines[0].endswith("only embed, evaluate, train run under torchrun")
    if argv[0] == "bench":
        assert "protocol.launcher: torchrun" in lines[0]
    assert not (tmp_path / "b").exists()


def test_the_torchrun_commands_are_not_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for command in ("train", "embed", "evaluate"):
        _ranks.refuse_under_torchrun(command)
    monkeypatch.setenv("WORLD_SIZE", "1")
    _ranks.refuse_under_torchrun("bench")
