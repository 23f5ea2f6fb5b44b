"""Embedding shards on disk (dmlkit.embedding_shards): format, writer, reader, and `dmlkit embed
--format shards` streaming from a trained model."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from dmlkit.data.base import ArrayDataset
from dmlkit.embedding_shards import (
    MANIFEST,
    SHARD_LOCK,
    ShardWriter,
    embed_to_shards,
    is_shard_dir,
    open_shards,
    write_shards,
)
from dmlkit.embeddings import InferenceOptions, embed
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError, NonFiniteError, ShapeError


def _data(n: int = 1000, d: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)).astype(np.float32), rng.integers(0, 40, n).astype(np.int64)


def test_round_trip_across_shard_boundaries(tmp_path):
    x, y = _data()
    ids = np.arange(5000, 6000, dtype=np.int64)
    with ShardWriter(tmp_path / "s", shard_rows=300, metadata={"note": "x"}) as w:
        for a0, a1 in [(0, 7), (7, 301), (301, 900), (900, 1000)]:  # batches straddle shards
            w.append(x[a0:a1], y[a0:a1], ids[a0:a1])
    s = open_shards(tmp_path / "s", verify=True)
    assert is_shard_dir(tmp_path / "s") and not is_shard_dir(tmp_path)
    assert s.shape == (1000, 12) and len(s) == 1000 and s.dtype == np.float32
    assert [sh["rows"] for sh in s.manifest["shards"]] == [300, 300, 300, 100]
    assert s.manifest["metadata"] == {"note": "x"}
    np.testing.assert_array_equal(s.to_numpy(), x)
    np.testing.assert_array_equal(s.labels, y)
    np.testing.assert_array_equal(s.ids, ids)
    np.testing.assert_array_equal(s[299:601], x[299:601])  # spans three shards
    np.testing.assert_array_equal(s[-1], x[-1])
    np.testing.assert_array_equal(s[10:20:3], x[10:20:3])
    rows = np.array([999, 0, 300, 300, 299, 5])  # any order, repeats
    np.testing.assert_array_equal(s[rows], x[rows])
    np.testing.assert_array_equal(s[torch.tensor(rows)], x[rows])
    blocks = list(s.blocks(333))
    assert [b0 for b0, _ in blocks] == [0, 333, 666, 999]
    np.testing.assert_array_equal(np.concatenate([b for _, b in blocks]), x)
    # plain numpy reads a shard without dmlkit, memory-mapped
    first = np.load(tmp_path / "s" / s.manifest["shards"][0]["embeddings"], mmap_mode="r")
    assert isinstance(first, np.memmap) and first.shape == (300, 12)


def test_float16_storage_decodes_to_float32_of_the_rounded_values(tmp_path):
    x, y = _data(500)
    s = write_shards(tmp_path / "h", x, y, dtype="float16", shard_rows=128)
    assert s.storage_dtype == np.float16 and s.nbytes_stored == 500 * 12 * 2
    got = s.to_numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(s.ids, np.arange(500))  # default ids: row numbers
    assert np.abs(got - x).max() <= 2.0**-11 * np.abs(x).max()


def test_writer_refuses_bad_input_with_clear_errors(tmp_path):
    x, y = _data(10)
    with pytest.raises(ConfigError, match="dtype"):
        ShardWriter(tmp_path / "a", dtype="int8")
    with pytest.raises(ConfigError, match="shard_rows"):
        ShardWriter(tmp_path / "a", shard_rows=0)
    w = ShardWriter(tmp_path / "a")
    w.append(x, y)
    with pytest.raises(ShapeError, match="dimensions"):
        w.append(x[:, :5], y)
    with pytest.raises(ShapeError, match="labels"):
        w.append(x, y[:3])
    bad = x.copy()
    bad[3, 1] = np.nan
    with pytest.raises(NonFiniteError):
        w.append(bad, y)
    with pytest.raises(DataError, match="integers"):
        w.append(x, y.astype(np.float64))
    w.close()
    with pytest.raises(NonFiniteError, match="float16"):
        ShardWriter(tmp_path / "b", dtype="float16").append(x * 1e5, y)
    with pytest.raises(DataError, match="overwrite") as refused:
        ShardWriter(tmp_path / "a")
    # every rank of a torchrun job meets it: printed once, by rank 0 (it was once per rank)
    from dmlkit.distributed import raised_on_every_rank

    assert raised_on_every_rank(refused.value)
    with pytest.raises(DataError, match="no embeddings"):
        ShardWriter(tmp_path / "empty").close()


def test_overwrite_replaces_the_old_shards(tmp_path):
    x, y = _data(50)
    write_shards(tmp_path / "s", x, y, shard_rows=10)
    s = write_shards(tmp_path / "s", x[:7], y[:7], shard_rows=10, overwrite=True)
    assert len(s) == 7
    names = sorted(p.name for p in (tmp_path / "s").glob("*.npy"))  # the old five shards are gone
    assert len(names) == 3 and [n.split("-")[0] for n in names] == ["embeddings", "ids", "labels"]
    assert {n for shard in s.manifest["shards"] for n in (shard["embeddings"], shard["labels"], shard["ids"])} == set(names)


def test_an_interrupted_overwrite_keeps_the_old_shards_readable(tmp_path):
    """--overwrite removed the old data first: a rerun killed mid-write lost both."""
    x, y = _data(50)
    write_shards(tmp_path / "s", x, y, shard_rows=10)
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "s", shard_rows=10, overwrite=True) as w:
        w.append(x[:30] + 1, y[:30])  # three new shards flushed, then the crash
        raise RuntimeError("killed mid-write")
    old = open_shards(tmp_path / "s", verify=True)
    assert len(old) == 50 and np.array_equal(np.asarray(old[:]), x)
    # an unreadable manifest does not block the overwrite meant to replace it
    (tmp_path / "s" / MANIFEST).write_text("{not json")
    assert len(write_shards(tmp_path / "s", x[:7], y[:7], shard_rows=10, overwrite=True)) == 7
    assert len(list((tmp_path / "s").glob("embeddings-*.npy"))) == 1


def test_a_failed_or_killed_overwrite_leaves_no_orphan_shard_files(tmp_path, monkeypatch):
    """`embed --format shards --overwrite` that failed (here: the disk full while its fourth
    file is saved) or was killed left its new shard files (and a `.embeddings-*.npy.tmp`) in the
    directory for good: the next overwrite removed only the files the old manifest listed. A
    failed writer removes its own files; an overwrite removes every shard-named file its
    manifest does not list (the leftovers of a killed one)."""
    x, y = _data(50)
    d = tmp_path / "s"
    write_shards(d, x, y, shard_rows=10)
    before = sorted(os.listdir(d))
    real_save, saves = np.save, []

    def disk_full_on_the_fourth(fh, arr, **kwargs):
        saves.append(1)
        if len(saves) == 4:
            fh.write(b"\x93NUMPY")  # part of the file, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(fh, arr, **kwargs)

    monkeypatch.setattr(np, "save", disk_full_on_the_fourth)
    with pytest.raises(OSError):
        write_shards(d, x[:30] + 1, y[:30], shard_rows=10, overwrite=True)
    monkeypatch.setattr(np, "save", real_save)
    assert sorted(os.listdir(d)) == before
    assert len(open_shards(d, verify=True)) == 50
    for name in ("embeddings-dead0-00000.npy", "ids-dead0-00000.npy", ".labels-dead0-00001.npy.tmp"):
        (d / name).write_bytes(b"left by a killed --overwrite")
    new = write_shards(d, x[:7], y[:7], shard_rows=10, overwrite=True)
    listed = {shard[key] for shard in new.manifest["shards"] for key in ("embeddings", "labels", "ids")}
    assert set(os.listdir(d)) == listed | {MANIFEST, SHARD_LOCK}


def test_an_interrupted_write_leaves_no_manifest_and_is_refused(tmp_path):
    x, y = _data(100)
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "s", shard_rows=30) as w:
        w.append(x, y)
        raise RuntimeError("crash mid-write")
    assert not (tmp_path / "s" / MANIFEST).exists()
    with pytest.raises(DataError, match="interrupted"):
        open_shards(tmp_path / "s")
    with pytest.raises(DataNotFoundError):
        open_shards(tmp_path / "missing")


def test_reader_detects_corruption_and_inconsistent_manifests(tmp_path):
    x, y = _data(100)
    s = write_shards(tmp_path / "s", x, y, shard_rows=40)
    name = s.manifest["shards"][1]["embeddings"]
    data = np.load(tmp_path / "s" / name)
    data[0, 0] += 1
    np.save(tmp_path / "s" / name, data)
    open_shards(tmp_path / "s")  # opening alone does not hash
    with pytest.raises(DataError, match="digest"):
        open_shards(tmp_path / "s", verify=True)
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    manifest["count"] = 99
    (tmp_path / "s" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="add up"):
        open_shards(tmp_path / "s")
    manifest["count"] = 100
    manifest["shards"][0]["embeddings"] = "../outside.npy"
    (tmp_path / "s" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="outside"):
        open_shards(tmp_path / "s")
    manifest["shards"][0]["embeddings"] = s.manifest["shards"][1]["embeddings"]  # 40 rows listed, 40 there
    manifest["shards"][2]["embeddings"] = s.manifest["shards"][0]["embeddings"]  # 20 listed, 40 there
    (tmp_path / "s" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"lists the shard file {s.manifest['shards'][1]['embeddings']} twice"):
        open_shards(tmp_path / "s")  # its rows would be read twice
    manifest["shards"][1]["embeddings"] = s.manifest["shards"][2]["embeddings"]  # 40 listed, 20 there
    (tmp_path / "s" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="manifest says"):
        open_shards(tmp_path / "s")
    t = write_shards(tmp_path / "t", x, y)
    assert t[90:101].shape == (10, 12)  # a slice is clipped, like numpy's ...
    with pytest.raises(ShapeError):
        t.read(90, 101)  # ... an explicit read out of range is refused
    with pytest.raises(ShapeError):
        t[np.array([100])]


def test_embed_to_shards_streams_the_inference_loop(tmp_path):
    torch.manual_seed(0)
    feats = np.random.default_rng(1).standard_normal((203, 6)).astype(np.float32)
    dataset = ArrayDataset(feats, np.arange(203) % 7, kind="features")
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5))
    model.train()
    options = InferenceOptions(batch_size=32, device="cpu")
    s = embed_to_shards(model, dataset, tmp_path / "s", options, shard_rows=50)
    assert model.training  # modes restored after the loop
    want, labels = embed(model, dataset, 32, "cpu")
    np.testing.assert_array_equal(s.to_numpy(), want)
    np.testing.assert_array_equal(s.labels, labels)
    np.testing.assert_array_equal(s.ids, np.arange(203))
    assert [sh["rows"] for sh in s.manifest["shards"]] == [50, 50, 50, 50, 3]
    sub = dataset.subset(np.arange(100, 150))
    s2 = embed_to_shards(model, sub, tmp_path / "sub", options, dtype="float16")
    np.testing.assert_array_equal(s2.ids, np.arange(100, 150))  # ids are the dataset rows

    class Diverged(nn.Module):
        def forward(self, x):
            return x / 0.0

    with pytest.raises(NonFiniteError):
        embed_to_shards(Diverged(), dataset, tmp_path / "bad", options)
    assert not (tmp_path / "bad" / MANIFEST).exists()


@pytest.mark.slow
def test_cli_embed_shards_then_evaluate_the_directory(tmp_path, capsys, data_root):
    """`dmlkit embed --format shards --dtype float16` on a trained Omniglot run, then `dmlkit
    evaluate SHARD_DIR` equals evaluate() on the values the shards hold."""

    from _reference import omniglot_run_config, run_cli
    from dmlkit.metrics import evaluate

    omniglot_run_config(tmp_path, "shards", train=range(0, 8), val=range(20, 24), file="c.yaml",
                        sampler={"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 1},
                        training={"epochs": 1, "device": "cpu"})

    def run(*args):
        code, out, err = run_cli(capsys, *args)
        return code, " ".join((out + err).split())

    code, out = run("train", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run"),
                    "--data-root", str(data_root), "--quiet")
    assert code == 0, out
    code, out = run("embed", str(tmp_path / "run"), "--format", "shards", "--dtype", "float16",
                    "--shard-rows", "64", "--quiet")
    assert code == 0, out
    shards = open_shards(tmp_path / "run" / "embeddings" / "test-shards", verify=True)
    with np.load(tmp_path / "run" / "embeddings" / "test.npz") as ref:
        np.testing.assert_allclose(shards.to_numpy(), ref["embeddings"].astype(np.float16), rtol=0, atol=1e-3)
        np.testing.assert_array_equal(shards.labels, ref["labels"])
        np.testing.assert_array_equal(shards.ids, ref["indices"])
    assert len(shards.manifest["shards"]) == -(-len(shards) // 64)
    code, out = run("evaluate", str(shards.directory), "--memory-budget", "1", "--json")
    assert code == 0, out
    want = evaluate(shards.to_numpy(), shards.labels)
    assert json.loads(out) == want
    code, out = run("embed", str(tmp_path / "run"), "--format", "shards", "--quiet")
    assert code == 2 and "overwrite" in out


def test_index_and_query_stream_from_shard_directories(tmp_path, capsys):
    """`dmlkit index SHARD_DIR` adds block by block and finds what an index of the same array
    finds; `dmlkit query INDEX SHARD_DIR` searches block by block; `--add SHARD_DIR` appends."""
    from dmlkit.apps import EmbeddingIndex
    from dmlkit.cli import main

    x, y = _data(700, d=16, seed=3)
    write_shards(tmp_path / "ref", x[:500], y[:500], ids=np.arange(500) + 10_000, shard_rows=128)
    write_shards(tmp_path / "q", x[500:], y[500:], ids=np.arange(200), shard_rows=64)
    idx = EmbeddingIndex(None, dim=16)
    assert idx.add_blocks(open_shards(tmp_path / "ref"), rows=100) == 500
    want = EmbeddingIndex(x[:500], y[:500], (np.arange(500) + 10_000).astype(str))
    got_r, want_r = idx.search(x[500:], 5), want.search(x[500:], 5)
    np.testing.assert_array_equal(got_r.ids, want_r.ids)
    np.testing.assert_array_equal(idx.labels, y[:500])

    def run(*args):
        try:
            main(list(args))
        except SystemExit as exc:
            assert not exc.code
        return capsys.readouterr().out

    run("index", str(tmp_path / "ref"), "-o", str(tmp_path / "index"))
    run("query", str(tmp_path / "index"), str(tmp_path / "q"), "-k", "5", "-o", str(tmp_path / "res.json"))
    res = json.loads((tmp_path / "res.json").read_text())
    assert [r["query"] for r in res] == [str(i) for i in range(200)]
    assert [[hit["id"] for hit in r["results"]] for r in res] == want_r.ids.tolist()
    run("index", str(tmp_path / "q"), "-o", str(tmp_path / "index"), "--add")
    assert len(EmbeddingIndex.load(tmp_path / "index")) == 700


def _fewer_rows_than_ranks(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    from dmlkit.distributed import init_distributed, shutdown

    init_distributed("cpu", timeout_s=120)
    torch.manual_seed(0)
    feats = np.arange(12, dtype=np.float32).reshape(2, 6)
    model = nn.Linear(6, 4)
    s = embed_to_shards(model, ArrayDataset(feats, np.array([3, 5]), kind="features"), out_dir,
                        InferenceOptions(batch_size=8, device="cpu"))
    assert len(s) == 2 and s.labels.tolist() == [3, 5]
    shutdown()


def test_fewer_rows_than_ranks_are_written_once_by_rank_0(tmp_path):
    """3 gloo ranks, 2 rows: every rank wrote the whole split into the same directory (a
    'holds embedding shards' error on the others and orphaned files beside the manifest's)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_fewer_rows_than_ranks, args=(3, port, str(tmp_path / "s")), nprocs=3, join=True)
    s = open_shards(tmp_path / "s", verify=True)
    torch.manual_seed(0)
    want = nn.Linear(6, 4)(torch.arange(12, dtype=torch.float32).reshape(2, 6)).detach().numpy()
    np.testing.assert_allclose(s.to_numpy(), want, rtol=1e-6)
    listed = {MANIFEST, SHARD_LOCK} | {shard[key] for shard in s.manifest["shards"] for key in ("embeddings", "labels", "ids")
                           if key in shard}
    assert {p.name for p in (tmp_path / "s").iterdir()} == listed  # no orphaned files
