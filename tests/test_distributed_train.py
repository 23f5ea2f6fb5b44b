"""`dmlkit train` under torchrun: 2 gloo processes train, validate and test like 1 process.

The real CLI is launched with ``python -m torch.distributed.run --nproc-per-node 2`` on the
Binary Alphadigits data (20 x 16 images, no random augmentation) with a small CNN whose
BatchNorm layers train (so they are converted to global-batch BatchNorm) and a triplet loss
with the batch-hard miner. The 2-rank run is trained for one epoch, then resumed under torchrun
for a second one; a one-process run of both epochs is the reference: per-step losses
(relative 1e-5), final weights (norm of the difference / norm, 1e-5), the step-0 baseline
metrics (bit-equal: sharded embedding is exact), the trained validation/test metrics and the
test embeddings in dataset order. The log holds every global step once; rank 0 alone prints.
The same job trains a frozen-trunk run (trunk features extracted in shards, one cache file per
rank and split) and checks the helpers ``train()`` relies on (``on_main``, the config digest,
``embed_sharded``). Resuming with another world size is refused (and works when allowed); a
world size that does not divide the global batch is one error line.
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
import torch
import yaml

from dmlkit.cli import main
from dmlkit.config import config_from_dict
from dmlkit.exceptions import CheckpointError
from dmlkit.training import read_checkpoint, read_log, train

pytestmark = [pytest.mark.usefixtures("one_thread"),
              # a 6-step run need not beat the untrained model; the comparison is the point
              pytest.mark.filterwarnings("ignore:training did not beat")]

CONFIG = {
    "name": "ddp-tiny",
    "seed": 3,
    "data": {"dataset": "binary_alphadigits", "split": {"kind": "default", "val_fraction": 0.25}},
    "model": {"trunk": "small_cnn", "trunk_options": {"widths": [8, 16], "bn_neck": True},
              "pretrained": False, "in_channels": 1, "embedding_size": 16, "freeze_batchnorm": False},
    "loss": {"name": "triplet", "params": {"margin": 0.2}},
    "miner": {"name": "batch_hard"},
    "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 3},
    "optimizer": {"preset": "cpu_quick"},
    "training": {"epochs": 2, "device": "cpu", "log_every": 1},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: One torchrun launch runs the CLI twice (one epoch, then ``--resume`` for the second) and then
#: :func:`helper_checks`, so the tests pay for starting the processes once.
DRIVER = """
import os, sys
sys.path.insert(0, {tests!r})
from dmlkit.cli import main
from test_distributed_train import helper_checks
out_file, frozen_dir, args = sys.argv[1], sys.argv[2], sys.argv[3:]
main(args + ["--set", "training.epochs=1"])
if os.environ["RANK"] == "0":
    print("FIRST-RUN-DONE", flush=True)
main(args + ["--resume"])
main(args[:2] + ["--run-dir", frozen_dir] + args[4:] + {frozen!r})
main(["embed", args[3], "-o", out_file + ".embed.npz", "--data-root", args[5], "-q"])
main(["embed", args[3], "--format", "shards", "--shard-rows", "40", "-o", out_file + ".shards",
      "--data-root", args[5], "-q"])
helper_checks(out_file)
"""


def _frozen(cache_dir: Path) -> dict:
    """A frozen-trunk run's overrides: the trunk's features are extracted and cached (per rank:
    in shards)."""
    return {"model.frozen_trunk": True, "model.freeze_batchnorm": True,
            "model.feature_cache_dir": str(cache_dir)}


def _torchrun(script: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc: parent ids), children before grandchildren."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _wait_gone(pids: list[int], deadline: float) -> list[int]:
    """Wait until every process of ``pids`` has exited; returns those still alive at ``deadline``."""
    import time

    alive = []
    for pid in pids:
        while time.time() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                break  # gone
            if state == "Z":
                break  # dead, waiting to be reaped by its new parent
            time.sleep(0.05)
        else:
            alive.append(pid)
    return alive


#: 1 and 2 ranks give the same losses and weights up to float32 rounding: each rank convolves
#: half the batch, and the CPU's channels-last convolutions block by batch size (measured up to
#: 1.01e-5 relative in the first loss and 1.8e-5 in a BatchNorm bias after 6 Adam steps, which
#: scale small gradients up); a wrong scale or order of the gathered batch is off by far more.
ROUNDING_RTOL = 1e-4


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_log(run / "log.jsonl") if r["event"] == "train"]


def _assert_same_weights(a: dict, b: dict, rel: float = ROUNDING_RTOL) -> None:
    assert a.keys() == b.keys()
    for key, ref in a.items():
        if ref.is_floating_point():
            diff = float((b[key].double() - ref.double()).norm())
            assert diff <= rel * max(float(ref.double().norm()), 1e-3), (key, diff)
        else:
            assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_root):
    """(one-process run dir, 2-rank run dir: one epoch, then resumed for another; torchrun's output).

    The same torchrun job also trains a frozen-trunk run (``tmp/two_frozen``, beside the
    one-process ``tmp/one_frozen``)."""
    tmp = tmp_path_factory.mktemp("ddp_train")
    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(CONFIG))
    torch.set_num_threads(1)
    one = tmp / "one"
    train(CONFIG, one, progress=False, data_root=data_root)
    train(config_from_dict(CONFIG).override(_frozen(tmp / "cache1")), tmp / "one_frozen",
          progress=False, data_root=data_root)

    two = tmp / "two"
    driver = tmp / "driver.py"
    driver.write_text(DRIVER.format(tests=str(Path(__file__).parent),
                                    frozen=[x for k, v in _frozen(tmp / "cache2").items()
                                            for x in ("--set", f"{k}={v}")]))
    proc = _torchrun(driver, str(tmp / "helpers.pt"), str(tmp / "two_frozen"), "train", str(cfg_path), "--run-dir", str(two), "--data-root",
                     str(data_root), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return one, two, proc


def test_two_ranks_train_like_one_process(runs):
    one, two, _ = runs
    ref, got = _losses(one), _losses(two)
    assert [s for s, _ in got] == list(range(1, 7))  # every global step once, in order
    assert [s for s, _ in ref] == [s for s, _ in got]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in ref], rtol=ROUNDING_RTOL)
    assert len({v for _, v in ref}) > 3  # the losses move: the comparison is not vacuous
    last1, last2 = read_checkpoint(one / "checkpoints" / "last.pt"), read_checkpoint(two / "checkpoints" / "last.pt")
    assert last2["world_size"] == 2 and len(last2["rng_ranks"]) == 2 and last1["world_size"] == 1
    assert last1["step"] == last2["step"] == 6
    _assert_same_weights(last1["model"], last2["model"])
    # the trunk's BatchNorm trained on global-batch statistics: running stats moved alike
    bn = [k for k in last1["model"] if k.endswith("running_var")]
    assert bn and all(not torch.allclose(last1["model"][k], torch.ones_like(last1["model"][k])) for k in bn)


def test_validation_and_test_metrics_match(runs):
    one, two, _ = runs
    m1, m2 = (json.loads((r / "metrics.json").read_text()) for r in (one, two))
    assert m1["baseline"] == m2["baseline"]  # step 0: same weights, sharded embedding is exact
    assert m1["best_step"] == m2["best_step"]
    for split in ("val", "test"):
        for key, value in m1[split].items():
            assert m2[split][key] == pytest.approx(value, abs=1e-3), (split, key)
    e1, e2 = (np.load(r / "embeddings" / "test.npz") for r in (one, two))
    np.testing.assert_array_equal(e1["indices"], e2["indices"])  # dataset order, no padding rows
    np.testing.assert_array_equal(e1["labels"], e2["labels"])
    np.testing.assert_allclose(e1["embeddings"], e2["embeddings"], atol=1e-4)
    evals = [r for r in read_log(two / "log.jsonl") if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]


def test_rank_zero_alone_writes_and_prints(runs):
    one, two, proc = runs
    names = sorted(p.relative_to(two).as_posix() for p in two.rglob("*"))
    assert names == sorted(p.relative_to(one).as_posix() for p in one.rglob("*"))
    assert not any(".tmp" in n for n in names)
    first, _ = proc.stdout.split("FIRST-RUN-DONE")
    assert first.count("test MAP@R") == 1, proc.stdout  # the summary: rank 0 only
    assert proc.stdout.count("test MAP@R") == 3  # three CLI runs in the job
    assert "Traceback" not in proc.stderr


def test_killed_under_torchrun_resumes_to_the_uninterrupted_run(runs, tmp_path, data_root):
    """SIGKILL the whole torchrun job once its first checkpoint exists, resume it under torchrun
    on the same world size: the weights, log and metrics are those of the 2-rank run that was
    only stopped at the epoch boundary (bit-equal), so nothing of a kill leaks into the result."""
    import signal
    import time

    _, two, _ = runs
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(CONFIG))
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), "-m", "dmlkit", "train", str(cfg_path),
           "--run-dir", str(killed), "--data-root", str(data_root), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    last = killed / "checkpoints" / "last.pt"
    deadline = time.time() + 150
    try:
        while not last.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
    finally:
        # torchrun starts each rank in a session of its own: kill the ranks, then torchrun
        ranks = _descendants(proc.pid)
        for pid in [*ranks, proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        survivors = _wait_gone(ranks, deadline=time.time() + 30)
    assert len(ranks) >= 2 and not survivors, (ranks, survivors)  # the job really died
    assert last.exists()
    assert read_checkpoint(last)["step"] < 6, "the run finished before it could be killed"

    cmd[cmd.index("--master-port") + 1] = str(_free_port())
    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a, b = read_checkpoint(two / "checkpoints" / "last.pt"), read_checkpoint(last)
    assert a["step"] == b["step"] == 6 and b["world_size"] == 2
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert _losses(killed) == _losses(two)
    m_two, m_killed = (json.loads((r / "metrics.json").read_text()) for r in (two, killed))
    assert {k: m_killed[k] for k in ("baseline", "best_step", "val", "test")} == \
        {k: m_two[k] for k in ("baseline", "best_step", "val", "test")}
    assert not [p for p in killed.rglob("*") if ".tmp" in p.name]  # the kill's leftovers swept


def test_resume_on_another_world_size_is_refused_unless_allowed(runs, tmp_path, data_root):
    import shutil

    _, two, _ = runs
    copy = tmp_path / "copy"
    shutil.copytree(two, copy)
    more = {**CONFIG, "training": {**CONFIG["training"], "epochs": 3}}
    with pytest.raises(CheckpointError, match="written by 2 process.*--allow-world-size-change"):
        train(more, copy, resume=True, progress=False, data_root=data_root)
    result = train(more, copy, resume=True, progress=False, data_root=data_root,
                   allow_world_size_change=True)
    assert result.steps == 9
    assert [s for s, _ in _losses(copy)] == list(range(1, 10))
    assert read_checkpoint(copy / "checkpoints" / "last.pt")["world_size"] == 1


def test_world_size_that_does_not_split_the_batch_is_one_line(tmp_path, capsys, monkeypatch):
    cfg = {**CONFIG, "sampler": {"classes_per_batch": 3, "samples_per_class": 3}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        main(["train", str(path), "--run-dir", str(tmp_path / "run"), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    text = " ".join(err.split())
    assert "3 x 3 = 9 items cannot be split evenly over 2 processes" in text
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    # rank 1, before the ranks joined: it waits (rank 0, failing the same way, prints the line
    # and torchrun stops rank 1 meanwhile), then prints its own, for a rank 0 that did not fail
    # (rank 1 alone was given other arguments: it printed nothing, and the job ended silently)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("dmlkit.commands._ranks.UNJOINED_DELAY_S", 0.0)
    with pytest.raises(SystemExit) as exc:
        main(["train", str(path), "--run-dir", str(tmp_path / "run"), "--quiet"])
    assert exc.value.code == 2 and "3 x 3 = 9 items cannot be split evenly" in capsys.readouterr().err


# -- the helpers train() relies on, checked in the same 2-rank process group ------------------
def helper_checks(out_file: str) -> None:
    """Run by both ranks of the torchrun job after the training runs (see DRIVER)."""
    from dmlkit.data.base import ArrayDataset
    from dmlkit.distributed import check_same_config, context, on_main, raised_on_every_rank
    from dmlkit.embeddings import embed, embed_sharded
    from dmlkit.exceptions import ConfigError, DataError

    rank = context().rank
    out: dict = {}

    def refuse() -> None:
        raise DataError("rank 0 refuses")

    try:
        on_main(refuse)
    except DataError as exc:  # every rank gets rank 0's error, marked for the CLI
        out["on_main"] = (str(exc), raised_on_every_rank(exc))
    out["value"] = on_main(lambda: f"from rank {rank}")
    try:
        check_same_config({"lr": 0.1 if rank == 0 else 0.2})
    except ConfigError as exc:
        out["config"] = str(exc)
    check_same_config({"lr": 0.1})  # equal configs pass
    x = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    ds = ArrayDataset(x, np.arange(7) % 3, kind="features")
    emb, labels = embed_sharded(lambda part: embed(torch.nn.Identity(), part, 2, "cpu"), ds)
    out["embedded"] = (torch.from_numpy(emb), torch.from_numpy(labels))
    torch.save(out, f"{out_file}.rank{rank}")


def test_distributed_helpers_with_two_processes(runs):
    _, two, _ = runs
    for rank in range(2):
        out = torch.load(f"{two.parent / 'helpers.pt'}.rank{rank}", weights_only=True)
        assert out["on_main"] == ("rank 0 refuses", True)
        assert out["value"] == "from rank 0"
        assert "different configs (ranks [0] have" in out["config"]
        emb, labels = out["embedded"]  # every row once, in dataset order (7 rows, 2 ranks)
        np.testing.assert_array_equal(emb.numpy(), np.arange(21, dtype=np.float32).reshape(7, 3))
        np.testing.assert_array_equal(labels.numpy(), np.arange(7) % 3)


def test_shard_bounds_cover_every_row_once():
    from dmlkit.distributed import shard_bounds

    for n in (0, 1, 5, 8, 1001):
        for world in (1, 2, 3, 8):
            parts = [shard_bounds(n, world, r) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


def test_frozen_trunk_features_are_extracted_in_shards(runs):
    one, two, _ = runs
    one, two = one.parent / "one_frozen", two.parent / "two_frozen"
    ref, got = _losses(one), _losses(two)
    assert [s for s, _ in got] == [s for s, _ in ref] == list(range(1, 7))
    np.testing.assert_allclose([v for _, v in got], [v for _, v in ref], rtol=ROUNDING_RTOL)
    _assert_same_weights(read_checkpoint(one / "checkpoints" / "last.pt")["model"],
                         read_checkpoint(two / "checkpoints" / "last.pt")["model"])
    assert (two / "checkpoints" / "trunk.pt").exists()
    # each rank cached its own shard of each split's features (train, val, test: 3 x 2 files)
    assert len(list((one.parent / "cache2").glob("*.npz"))) == 6
    assert len(list((one.parent / "cache1").glob("*.npz"))) == 3


def test_dmlkit_embed_under_torchrun_gathers_the_split_in_order(runs, tmp_path, data_root):
    from dmlkit.training import embed_run

    _, two, proc = runs
    _, emb, labels, _ = embed_run(two, "test", output=tmp_path / "one.npz", data_root=data_root)
    got = np.load(two.parent / "helpers.pt.embed.npz")
    np.testing.assert_array_equal(got["indices"], np.load(tmp_path / "one.npz")["indices"])
    np.testing.assert_array_equal(got["labels"], labels)
    np.testing.assert_allclose(got["embeddings"], emb, atol=1e-6)
    assert proc.stdout.count("helpers.pt.embed.npz: ") == 1  # rank 0 reports the file


def test_dmlkit_embed_shards_under_torchrun_writes_each_ranks_share(runs, tmp_path, data_root):
    """`torchrun ... dmlkit embed --format shards`: each rank embedded and wrote its contiguous
    half of the split (its own files), rank 0 wrote one manifest listing them in dataset order,
    and the directory reads back as the one-process embedding of the split."""
    from dmlkit.distributed import shard_bounds
    from dmlkit.embedding_shards import open_shards
    from dmlkit.training import embed_run

    _, two, proc = runs
    _, emb, labels, _ = embed_run(two, "test", output=tmp_path / "one.npz", data_root=data_root)
    one = np.load(tmp_path / "one.npz")
    got = open_shards(two.parent / "helpers.pt.shards", verify=True)
    np.testing.assert_array_equal(got.ids, one["indices"])
    np.testing.assert_array_equal(got.labels, labels)
    np.testing.assert_allclose(got.to_numpy(), emb, atol=1e-6)
    n = len(labels)
    files = [shard["embeddings"] for shard in got.manifest["shards"]]
    for rank in (0, 1):  # each rank's files hold its share of the rows, and only that
        start, stop = shard_bounds(n, 2, rank)
        mine = [s for s in got.manifest["shards"] if f"-r{rank:03d}-" in s["embeddings"]]
        assert mine and sum(s["rows"] for s in mine) == stop - start
        assert max(s["rows"] for s in mine) <= 40
    assert len(files) == len({*files}) and all("-r00" in f for f in files)
    assert got.manifest["metadata"]["split"] == "test"
    assert proc.stdout.count(f"{n} x 16 float32 embeddings") == 1  # rank 0 reports the directory


def test_random_augmentation_is_the_same_with_one_or_two_ranks():
    """Every item is loaded under a seed fixed by its place in the global batch, so the two
    ranks' shares of an epoch, put side by side, are the one-process batches, random
    augmentations included, with or without loader workers; the process's own RNG stream (which
    miners and losses draw from) is not advanced by loading."""
    from torch.utils.data import DataLoader

    from dmlkit.data.base import ArrayDataset
    from dmlkit.samplers import MPerClassSampler
    from dmlkit.training.seeding import SeededBatches, SeededItems

    labels = np.repeat(np.arange(6), 5)
    data = np.arange(30, dtype=np.float32).reshape(30, 1)
    noisy = ArrayDataset(data, labels, kind="features", transform=lambda x: x + torch.rand(x.shape))

    def epoch(num_replicas: int, rank: int, workers: int = 0) -> list[torch.Tensor]:
        sampler = MPerClassSampler(labels, samples_per_class=2, classes_per_batch=4, seed=5,
                                   batches_per_epoch=3, num_replicas=num_replicas, rank=rank)
        sampler.set_epoch(2)
        loader = DataLoader(SeededItems(noisy), batch_sampler=SeededBatches(sampler, 5, 2),
                            num_workers=workers, generator=torch.Generator().manual_seed(0))
        return [x for x, _ in loader]

    torch.manual_seed(0)
    before = torch.get_rng_state()
    one = epoch(1, 0)
    assert torch.equal(torch.get_rng_state(), before)
    two = [torch.cat(pair) for pair in zip(epoch(2, 0), epoch(2, 1), strict=True)]
    assert len(one) == 3
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
        assert not torch.equal(a, a.round())  # the noise is there: the check is not vacuous
    assert all(torch.equal(a, b) for a, b in zip(one, epoch(1, 0, workers=2), strict=True))
    sampler = MPerClassSampler(labels, samples_per_class=2, classes_per_batch=4, seed=5, batches_per_epoch=3)
    sampler.set_epoch(3)  # another epoch: other augmentations of the same kind of batch
    other = [x for x, _ in DataLoader(SeededItems(noisy), batch_sampler=SeededBatches(sampler, 5, 3),
                                      generator=torch.Generator())]
    assert not torch.equal(one[0], other[0])
