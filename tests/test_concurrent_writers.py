"""Two writers on one output (the concurrency audit): `track build-data`, shard directories
(`embed --format shards`, :class:`ShardWriter`), `index --add/--remove`, `patches build-data` and
`track train` each hold :func:`dmlkit.utils.directory_lock` on their output while they write.

A second writer is started at a controlled point of the first (a monkeypatched step calls it),
never by timing: it must be refused with one line naming the command, the process that holds
the lock and what to do, and the first must end with its own output intact. A lock left by a
killed process (the kernel drops a dead holder's ``flock``) blocks nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from _reference import one_error_line, siamfc_train_sequence, tiny_siamfc_config
from dmlkit.apps import EmbeddingIndex
from dmlkit.apps.patches import offline as patches_offline
from dmlkit.apps.patches.brown import _check_build_finished
from dmlkit.apps.tracking import offline as tracking_offline
from dmlkit.apps.tracking import training as tracking_training
from dmlkit.apps.tracking.datasets import load_got10k, load_otb
from dmlkit.cli import main
from dmlkit.data.base import ArrayDataset
from dmlkit.distributed import init_distributed, shutdown
from dmlkit.embedding_shards import ShardWriter, embed_to_shards, open_shards, write_shards
from dmlkit.embeddings import InferenceOptions, save_embeddings
from dmlkit.exceptions import DmlkitError
from dmlkit.utils import directory_lock

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: What every refusal names: the process holding the lock (this one, when it is the first writer).
HELD_HERE = f"held by process {os.getpid()} on "


def _cli(argv: list, capsys) -> tuple[int, str]:
    """``dmlkit ARGV`` in this process -> (exit code, stderr)."""
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def _kill_a_holder(lock_file: Path) -> None:
    """A process that takes ``lock_file``'s lock as :func:`directory_lock` does (writing its pid)
    and is killed while it holds it: the file stays behind, as after a SIGKILL of a writer."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    code = ("import fcntl, os, sys; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.truncate(0); f.write(f'{os.getpid()} host\\n'); f.flush(); print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock_file)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(DmlkitError, match=f"busy \\(held by process {holder.pid} on host\\)"):
            with directory_lock(lock_file.parent, lock_file.name, "busy"):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock_file.is_file()


def _second_writer_at(monkeypatch, owner, name: str, second) -> list:
    """Make the first call of ``owner.name`` run ``second()`` first; returns ``[its error]``."""
    real, refused, calls = getattr(owner, name), [], []

    def first_then_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the first writer's first call (a second writer let in calls it again)
            with pytest.raises(DmlkitError) as exc:
                second()
            refused.append(str(exc.value))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, first_then_second)
    return refused


# ---------------------------------------------------------------- track build-data
def _track_build(out: Path, seed: int, frames: int = 2) -> dict:
    return tracking_offline.build_offline_dataset(out, num_train=1, num_test=1, train_frames=frames,
                                                  test_frames=frames, seed=seed, frame_size=(96, 96))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix != ".lock"}


def test_a_second_track_build_into_a_folder_in_use_is_refused(tmp_path, monkeypatch, capsys):
    """Two `track build-data` into one folder both exited 0 and left a mix of both builds under
    one "complete" meta.json, which the loaders accepted."""
    out, ref = tmp_path / "bd", tmp_path / "ref"
    _track_build(ref, seed=0)
    refused = _second_writer_at(monkeypatch, tracking_offline, "write_sequence",
                                lambda: _track_build(out, seed=1, frames=3))
    meta = _track_build(out, seed=0)
    assert len(refused) == 1 and "another `dmlkit track build-data` is writing" in refused[0]
    assert HELD_HERE in refused[0] and "wait for it to end" in refused[0]
    assert meta["complete"] and meta["seed"] == 0
    assert _files(out) == _files(ref)  # exactly the first build
    assert len(load_got10k(out)) == 1 and len(load_otb(out / "test")) == 1
    monkeypatch.undo()
    _kill_a_holder(out / "build.lock")  # a killed build's lock blocks nothing
    _track_build(out, seed=0)
    with directory_lock(out, "build.lock", "busy"):  # the CLI: one line, exit 2
        code, err = _cli(["track", "build-data", out, "--train", "1", "--test", "1", "--frames", "2",
                          "--size", "96x96"], capsys)
    assert code == 2 and "another `dmlkit track build-data` is writing" in one_error_line(code, err)
    assert _files(out) == _files(ref)


# ---------------------------------------------------------------- shard directories
def _rows(seed: int, n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    return np.random.default_rng(seed).standard_normal((n, 6)).astype(np.float32), np.repeat(np.arange(8), n // 8)


@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "overwrite"])
def test_a_second_shard_writer_on_a_directory_in_use_is_refused(tmp_path, existing):
    """Two fresh writers into one new directory wrote the same file names (a silent mix of both
    writers' embeddings); two --overwrite writers removed each other's new shards."""
    d = tmp_path / "s"
    if existing:
        write_shards(d, *_rows(9), shard_rows=10)
    x, y = _rows(1)
    with ShardWriter(d, shard_rows=10, overwrite=existing) as first:
        first.append(x[:20], y[:20])  # two shards on disk
        for overwrite in (False, True):
            with pytest.raises(DmlkitError, match="another shard writer .* is writing") as refused:
                ShardWriter(d, shard_rows=10, overwrite=overwrite)
            assert HELD_HERE in str(refused.value) and "\n" not in str(refused.value)
        first.append(x[20:], y[20:])
    got = open_shards(d, verify=True)
    assert np.array_equal(got.to_numpy(), x) and got.labels.tolist() == y.tolist()
    listed = {shard[key] for shard in got.manifest["shards"] for key in ("embeddings", "labels", "ids")}
    assert {p.name for p in d.iterdir()} == listed | {"manifest.json", "shards.lock"}  # nothing else left
    _kill_a_holder(d / "shards.lock")  # released at close; a killed writer's lock blocks nothing
    assert write_shards(d, *_rows(2), shard_rows=10, overwrite=True).shape == (40, 6)


def test_an_overwrite_removes_only_the_leftovers_of_writers_no_longer_running(tmp_path):
    """Every writer names its files after its process: an overwrite removed every shard-named
    file, a running writer's new shards included (the lock keeps a second writer out; where a
    file system ignores it, a live process's files are still not taken for leftovers)."""
    d = tmp_path / "s"
    write_shards(d, *_rows(9), shard_rows=10)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    live = os.getppid()  # the process that started this test: running
    for pid in (ended.pid, live):
        (d / f"embeddings-{pid}.0a0b0-00000.npy").write_bytes(b"a writer's shard")
    (d / "labels-00003.npy").write_bytes(b"an untagged one (an older version's): a leftover")
    got = write_shards(d, *_rows(1), shard_rows=10, overwrite=True)
    listed = {shard[key] for shard in got.manifest["shards"] for key in ("embeddings", "labels", "ids")}
    assert all(name.startswith(("embeddings", "labels", "ids")) and f"-{os.getpid()}." in name for name in listed)
    assert {p.name for p in d.iterdir()} == listed | {"manifest.json", "shards.lock",
                                                      f"embeddings-{live}.0a0b0-00000.npy"}


def _ranks_meet_a_directory_in_use(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of a gloo job embedding 4 rows (2 a rank) as shards into ``out_dir``; a refusal
    is written to ``refused-<rank>.txt`` beside it."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=120)
    feats = np.arange(24, dtype=np.float32).reshape(4, 6)
    try:
        embed_to_shards(nn.Linear(6, 4), ArrayDataset(feats, np.array([0, 0, 1, 1]), kind="features"), out_dir,
                        InferenceOptions(batch_size=8, device="cpu"))
    except DmlkitError as exc:
        (Path(out_dir).parent / f"refused-{rank}.txt").write_text(str(exc))
    shutdown()


def test_every_rank_of_a_job_is_refused_a_directory_in_use(tmp_path):
    """Under torchrun rank 0 takes the lock before any rank writes, and its refusal ends every
    rank (none waits for it in a collective, none writes a file)."""
    d = tmp_path / "s"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with directory_lock(d, "shards.lock", "busy"):
        mp.spawn(_ranks_meet_a_directory_in_use, args=(2, port, str(d)), nprocs=2, join=True)
    for rank in (0, 1):
        message = (tmp_path / f"refused-{rank}.txt").read_text()
        assert message.startswith(f"another shard writer (`dmlkit embed --format shards`) is writing {d}")
        assert HELD_HERE in message
    assert [p.name for p in d.iterdir()] == ["shards.lock"]


# ---------------------------------------------------------------- dmlkit index --add/--remove
def _batch(path: Path, start: int, n: int) -> Path:
    rng = np.random.default_rng(start)
    save_embeddings(path, rng.standard_normal((n, 8)).astype(np.float32), np.arange(n) % 4,
                    indices=np.arange(start, start + n))
    return path


def test_a_second_index_change_while_one_runs_is_refused(tmp_path, monkeypatch, capsys):
    """Two `index NEW -o IDX --add` at once both exited 0 and the index held one batch: each
    loaded the index, added its own and saved it over the other's."""
    idx = tmp_path / "idx"
    base, add1, add2 = _batch(tmp_path / "b.npz", 0, 30), _batch(tmp_path / "a1.npz", 30, 5), _batch(tmp_path / "a2.npz", 35, 5)
    assert _cli(["index", base, "-o", idx], capsys)[0] == 0
    seconds: list[tuple[int, str]] = []

    def other_commands():  # while the first --add is between its load and its save
        seconds.extend(_cli(argv, capsys) for argv in (["index", add2, "-o", idx, "--add"],
                                                       ["index", "-o", idx, "--remove", "0"],
                                                       ["index", add2, "-o", idx]))
        raise DmlkitError("stop")

    refused = _second_writer_at(monkeypatch, EmbeddingIndex, "save", other_commands)
    code, err = _cli(["index", add1, "-o", idx, "--add"], capsys)
    assert code == 0 and refused == ["stop"]
    for code, err in seconds:
        line = one_error_line(code, err)
        assert code == 2 and f"another `dmlkit index` is writing {idx}" in line and HELD_HERE in line
    assert sorted(map(int, EmbeddingIndex.load(idx).ids)) == list(range(35))  # base + the first batch
    monkeypatch.undo()
    _kill_a_holder(tmp_path / ".idx.lock")  # released; a killed command's lock blocks nothing
    assert _cli(["index", add2, "-o", idx, "--add"], capsys)[0] == 0  # the retry adds its batch
    assert len(EmbeddingIndex.load(idx)) == 40


# ---------------------------------------------------------------- patches build-data
def test_a_second_patches_build_into_a_root_in_use_is_refused(tmp_path, monkeypatch, capsys):
    """Two `patches build-data -o ROOT` at once: manifest.json lost the first's subsets (read by
    both at the start, rewritten by each), and the second removed the first's staging folders."""
    root = tmp_path / "pd"
    spec = patches_offline.OfflineSpec(points_per_subset=20, views=2, train_pairs=40, test_pairs=20, seed=0)
    other = patches_offline.OfflineSpec(points_per_subset=20, views=2, train_pairs=40, test_pairs=20, seed=1)
    refused = _second_writer_at(monkeypatch, patches_offline, "build_offline_subset",
                                lambda: patches_offline.build_offline_dataset(root, other, ("photos",)))
    summary = patches_offline.build_offline_dataset(root, spec, ("photos", "textures"))
    assert len(refused) == 1 and "another `dmlkit patches build-data` is writing" in refused[0]
    assert HELD_HERE in refused[0]
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest == json.loads(json.dumps(summary)) and sorted(manifest["subsets"]) == ["photos", "textures"]
    for name in ("photos", "textures"):
        _check_build_finished(root / name, name)
        assert manifest["subsets"][name]["spec"]["seed"] == 0
    monkeypatch.undo()
    with directory_lock(root, "build.lock", "busy"):  # the CLI: one line, exit 2
        code, err = _cli(["patches", "build-data", "-o", root, "--subset", "photos"], capsys)
    assert code == 2 and "another `dmlkit patches build-data` is writing" in one_error_line(code, err)
    assert json.loads((root / "manifest.json").read_text()) == manifest
    _kill_a_holder(root / "build.lock")  # a killed build's lock blocks nothing
    assert sorted(patches_offline.build_offline_dataset(root, other, ("photos",))["subsets"]) == ["photos", "textures"]


# ---------------------------------------------------------------- track train
def test_a_second_track_train_into_a_run_directory_in_use_is_refused(tmp_path, monkeypatch):
    """Two `track train` into one --run-dir both exited 0: log.jsonl interleaved both runs'
    steps, and last.pt, config.yaml and metrics.json came from either."""
    run_dir = tmp_path / "run"
    seq = [siamfc_train_sequence()]
    cfg = tiny_siamfc_config(tmp_path, epochs=3)
    seconds: list[str] = []

    def other_runs():  # a fresh start and a resume, while the first is in its first epoch
        for resume in (False, True):
            with pytest.raises(DmlkitError) as exc:
                tracking_training.train_siamfc(cfg, run_dir, seq, progress=False, resume=resume)
            seconds.append(str(exc.value))
        raise DmlkitError("stop")

    _second_writer_at(monkeypatch, tracking_training, "save_siamfc", other_runs)
    result = tracking_training.train_siamfc(cfg, run_dir, seq, progress=False, max_epochs=2)
    assert len(seconds) == 2
    for message in seconds:
        assert f"another `dmlkit track train` is using {run_dir}" in message and HELD_HERE in message
    steps = [json.loads(line)["step"] for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and result["epochs"] == 2
    assert json.loads((run_dir / "metrics.json").read_text())["epochs"] == 2
    monkeypatch.undo()
    _kill_a_holder(run_dir / "train.lock")  # released; a killed run's lock blocks nothing
    more = tracking_training.train_siamfc(cfg, run_dir, seq, progress=False, resume=True)  # released: resumable
    assert more["epochs"] == 3 and more["steps"] == 3
