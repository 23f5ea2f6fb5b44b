"""Retrieval apps (index, query, serve, export) as a new user runs them: the findings of a
new-user pass over docs/search.md, each checked against an independent computation or the
files on disk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dmlkit.apps.export import export_model
from dmlkit.exceptions import DataError


def _fake_run(tmp_path: Path) -> Path:
    """A run directory's files that an export must never replace (their contents are markers)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "embeddings").mkdir()
    (run / "checkpoints" / "best.pt").write_bytes(b"checkpoint")
    (run / "embeddings" / "test.npz").write_bytes(b"embeddings")
    (run / "metrics.json").write_text('{"test": {"map_at_r": 0.4}}')
    return run


@pytest.mark.parametrize("target", ["embeddings/test.npz", "checkpoints/best.pt", "metrics", "checkpoints/model.pt"])
def test_export_never_replaces_a_file_that_is_not_an_earlier_export(tmp_path, target, run_cli):
    # `dmlkit export run -o run/embeddings/test.npz` replaced the embeddings with a model,
    # `-o run/checkpoints/best.pt` the checkpoint being exported, and `-o run/metrics` wrote
    # the manifest over run/metrics.json: each exited 0
    run = _fake_run(tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, out, err = run_cli(["export", str(run), "--format", "torchscript", "-o", str(run / target)])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "choose another output path" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_export_of_a_real_run_keeps_its_embeddings_and_checkpoint(tmp_path_factory, data_root, tmp_path, run_cli):
    from test_service import trained_run

    run = tmp_path / "run"
    shutil.copytree(trained_run(tmp_path_factory, data_root), run)
    kept = {name: (run / name).read_bytes() for name in ("embeddings/test.npz", "checkpoints/best.pt")}
    for name in kept:
        code, _, err = run_cli(["export", str(run), "--format", "torchscript", "--parity-samples", "12",
                                "--data-root", str(data_root), "-o", str(run / name)])
        assert code == 2 and "choose another output path" in err, err
    assert {name: (run / name).read_bytes() for name in kept} == kept
    # the default output is still written, and written again (an earlier export is replaced)
    for _ in range(2):
        code, out, err = run_cli(["export", str(run), "--format", "torchscript", "--parity-samples", "12",
                                  "--data-root", str(data_root)])
        assert code == 0, err
    assert (run / "export" / "model.pt").is_file() and (run / "export" / "model.pt.json").is_file()


def test_export_refuses_an_output_directory_and_a_checkpoint_file_given_as_the_run(tmp_path):
    run = _fake_run(tmp_path)
    (tmp_path / "out").mkdir()
    with pytest.raises(DataError, match="is a directory"):
        export_model(run, "onnx", tmp_path / "out")
    ckpt = run / "checkpoints" / "best.pt"
    with pytest.raises(DataError, match="checkpoints the export reads"):
        export_model(ckpt, "torchscript", ckpt)
    assert ckpt.read_bytes() == b"checkpoint"


def test_export_still_replaces_an_earlier_export(tmp_path):
    # an earlier export (its manifest beside it) is not refused: the refusal comes later, from
    # the fake checkpoint, not from the output check
    run = _fake_run(tmp_path)
    out = tmp_path / "model.onnx"
    out.write_bytes(b"old model")
    (tmp_path / "model.onnx.json").write_text(json.dumps({"manifest": "dmlkit-export-v1", "format": "onnx"}))
    with pytest.raises(Exception) as info:
        export_model(run, "onnx", out)
    assert "choose another output path" not in str(info.value)


@pytest.fixture
def small_hnsw(tmp_path, run_cli):
    """An HNSW index of 300 seeded random embeddings with ids ``f0`` ... ``f299``."""
    import numpy as np

    rng = np.random.default_rng(0)
    emb = tmp_path / "emb.npz"
    np.savez(emb, embeddings=rng.normal(size=(300, 8)).astype(np.float32), ids=np.array([f"f{i}" for i in range(300)]))
    index = tmp_path / "idx"
    code, _, err = run_cli(["index", str(emb), "-o", str(index), "--kind", "hnsw", "--recall-queries", "20"])
    assert code == 0, err
    return index


def test_index_remove_with_target_recall_re_tunes_and_json_is_json(small_hnsw, run_cli):
    # --target-recall and --json given with --add/--remove were silently ignored: the recall
    # stayed stale and the output was text
    code, out, err = run_cli(["index", "-o", str(small_hnsw), "--remove", "f1", "--target-recall", "0.9",
                              "--recall-queries", "30", "--json"])
    assert code == 0, err
    summary = json.loads(out)
    assert summary["count"] == 299 and summary["removed"] == 1 and summary["added"] == 0
    rec = json.loads((small_hnsw / "index.json").read_text())["recall"]
    assert rec["stale"] is False and rec["target"] == 0.9 and rec["met"] is True and rec["num_queries"] == 30
    assert summary["recall"]["setting"] == rec["setting"]


@pytest.mark.parametrize("option", [["--ef-search", "128"], ["--nlist", "4"], ["--hnsw-m", "8"], ["--recall-k", "5"],
                                    ["--seed", "3"]])
def test_index_add_remove_refuse_build_settings_they_would_ignore(small_hnsw, run_cli, option):
    before = (small_hnsw / "index.json").read_text()
    code, out, err = run_cli(["index", "-o", str(small_hnsw), "--remove", "f1", *option])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and option[0] in err
    assert (small_hnsw / "index.json").read_text() == before


@pytest.mark.parametrize(("x_scale", "q_scale"), [(1e-30, 1e-30), (1e20, 1e20), (1e30, 1.0), (1.0, 1e-40), ("unit", 1e-40),
                                                  ("unit", 1e30)])
@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot"])
def test_flat_index_finds_the_true_neighbours_of_tiny_and_huge_embeddings(x_scale, q_scale, distance):
    # the float32 candidate scan of the flat index multiplied raw vectors: 1e-30-scale products
    # underflowed to 0 and 1e20-scale ones overflowed, and it returned arbitrary rows (0 % and
    # 3 % of the true neighbours) where dmlkit.metrics.knn and the approximate kinds were right
    import numpy as np

    from dmlkit.apps import EmbeddingIndex
    from dmlkit.metrics import knn

    rng = np.random.default_rng(1)
    x, q = rng.normal(size=(300, 8)), rng.normal(size=(20, 8))
    xn, qn = x / np.linalg.norm(x, axis=1, keepdims=True), q / np.linalg.norm(q, axis=1, keepdims=True)
    xs = (xn if x_scale == "unit" else x * x_scale).astype(np.float32)
    qs = (q * q_scale).astype(np.float32)
    with np.errstate(all="raise"):  # no overflow on the way either
        found = EmbeddingIndex(xs, distance=distance).search(qs, 5).indices
    cos = qn @ xn.T  # float64, independent of dmlkit; the ranking of all three normalised distances
    truth = np.argsort(-cos, axis=1, kind="stable")[:, :5]
    assert (found == truth).all()
    assert (found == knn(qs, xs, k=5, distance=distance, exclude_self=False).indices.numpy()).all()


@pytest.mark.parametrize("as_json", [False, True])
def test_export_exits_1_on_failed_parity_with_and_without_json(monkeypatch, run_cli, tmp_path, as_json):
    # docs: "exits 1 if the parity check fails"; with --json it printed the report and exited 0
    import dmlkit.apps.export as export_module

    parity = {"num_samples": 12, "max_abs_diff": 0.5, "top10_identical": 0.5, "top10_overlap": 0.8,
              "map_at_r_torch": 0.4, "map_at_r_export": 0.2, "passed": False, "split": "test"}
    report = {"format": "onnx", "output": str(tmp_path / "m.onnx"), "parity_file": str(tmp_path / "m.onnx.json"),
              "runtime": "onnxruntime", "parity": parity}
    monkeypatch.setattr(export_module, "export_model", lambda *a, **k: report)
    code, out, err = run_cli(["export", str(tmp_path), *(["--json"] if as_json else [])])
    assert code == 1 and "parity check failed" in err
    if as_json:
        assert json.loads(out)["parity"]["passed"] is False


@pytest.mark.parametrize(("options", "words"), [
    (["--kind", "hnsw", "--nprobe", "16"], "--nprobe does not apply to hnsw"),
    (["--nprobe", "16"], "--nprobe does not apply to flat"),
    (["--target-recall", "0.9"], "--target-recall does not apply to flat"),
    (["--kind", "ivf_flat", "--ef-search", "100"], "--ef-search does not apply to ivf_flat"),
    (["--kind", "ivf_flat", "--pq-m", "4"], "--pq-m does not apply to ivf_flat"),
    (["--kind", "ivf_pq", "--nprobe", "2", "--target-recall", "0.9"], "--nprobe fixes the search setting"),
    (["--kind", "hnsw", "--ef-search", "32", "--target-recall", "0.9"], "--ef-search fixes the search setting"),
])
def test_index_refuses_settings_its_kind_would_ignore(tmp_path, run_cli, options, words):
    # each of these built an index that silently ignored the setting (an exact index for
    # `--nprobe 16` without --kind, the tuner's nprobe instead of the one given, ...)
    import numpy as np

    np.save(tmp_path / "emb.npy", np.random.default_rng(0).normal(size=(120, 8)).astype(np.float32))
    code, out, err = run_cli(["index", str(tmp_path / "emb.npy"), "-o", str(tmp_path / "idx"), *options])
    assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "idx").exists()


@pytest.mark.parametrize(("options", "words"), [
    (["--kind", "flat", "--hnsw-m", "32"], "--hnsw-m does not apply to flat"),
    (["--kind", "ivf_flat", "--ef-search", "64"], "--ef-search does not apply to ivf_flat"),
    (["--kind", "hnsw", "--ef-search", "64", "--target-recall", "0.95"], "--ef-search fixes the search setting"),
    (["--kind", "flat", "--recall-k", "10"], "--recall-k does not apply to flat"),
])
def test_index_refuses_a_setting_given_at_its_default_value(tmp_path, run_cli, options, words):
    """docs/search.md: these are refused, not ignored. Given at the default value they were
    accepted: the CLI told "given" from the value, not from the command line."""
    import numpy as np

    np.save(tmp_path / "emb.npy", np.random.default_rng(0).normal(size=(120, 8)).astype(np.float32))
    code, out, err = run_cli(["index", str(tmp_path / "emb.npy"), "-o", str(tmp_path / "idx"), *options])
    assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "idx").exists()
    code, _, _ = run_cli(["index", str(tmp_path / "emb.npy"), "-o", str(tmp_path / "idx")])
    assert code == 0
    code, _, err = run_cli(["index", "-o", str(tmp_path / "idx"), "--remove", "0", "--pq-nbits", "8"])
    assert code == 2 and "--pq-nbits sets how an index is built" in err


def test_index_accepts_every_setting_of_its_own_kind(tmp_path, run_cli):
    import numpy as np

    np.save(tmp_path / "emb.npy", np.random.default_rng(0).normal(size=(400, 8)).astype(np.float32))
    for options in (["--kind", "ivf_pq", "--nlist", "4", "--pq-m", "2", "--pq-nbits", "4", "--nprobe", "2", "--seed", "1",
                     "--recall-k", "5", "--recall-queries", "30"],
                    ["--kind", "hnsw", "--hnsw-m", "8", "--ef-construction", "20", "--target-recall", "0.9"]):
        code, out, err = run_cli(["index", str(tmp_path / "emb.npy"), "-o", str(tmp_path / "idx"), *options])
        assert code == 0, err


def test_service_refuses_an_all_zero_embedding_on_a_cosine_index():
    # a zero vector has no direction: it scored 0.0 against every item and the service answered
    # 200 with the index's first rows as "nearest"
    import numpy as np

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.service import ServiceConfig, create_app

    emb = np.random.default_rng(0).normal(size=(30, 4)).astype(np.float32)
    for distance, normalize, zero_status in (("cosine", True, 422), ("euclidean", True, 422), ("dot", False, 200)):
        idx = EmbeddingIndex(emb, distance=distance, normalize=normalize)
        client = TestClient(create_app(ServiceConfig(index="unused"), index=idx))
        res = client.post("/api/query/embedding", json={"embedding": [0.0, -0.0, 0.0, 0.0], "k": 3})
        assert res.status_code == zero_status, res.json()
        if zero_status == 422:
            assert "all zeros" in res.json()["detail"]
        # tiny is not zero: it has a direction (a float32 subnormal held exactly; 1e-40 itself is
        # not, and float64 rows float32 cannot hold are refused: test_index_audit_fixes.py)
        tiny = client.post("/api/query/embedding", json={"embedding": [2.0**-133, 0.0, 0.0, 0.0], "k": 3})
        assert tiny.status_code == 200


def test_serve_refuses_a_model_the_index_was_not_built_with(tmp_path_factory, data_root):
    # any model of the embedding size passed the start-up check, so image queries were searched
    # in another model's space and answered with unrelated items; here the index's vectors
    # belong to other images (rolled by ten rows: other subjects), as with another model's index
    import numpy as np

    pytest.importorskip("fastapi")
    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.index import item_ids
    from dmlkit.apps.service import ServiceConfig, create_app
    from dmlkit.exceptions import ConfigError
    from test_service import trained_run

    run = trained_run(tmp_path_factory, data_root)
    z = np.load(run / "embeddings" / "test.npz")
    ids, info = item_ids(run / "embeddings" / "test.npz", {"indices": z["indices"]}, data_root)
    config = ServiceConfig(index="unused", model=run, data_root=data_root)
    right = EmbeddingIndex(z["embeddings"], z["labels"], ids, info=info)
    assert create_app(config, index=right) is not None
    wrong = EmbeddingIndex(np.roll(z["embeddings"], 10, axis=0), z["labels"], ids, info=info)
    with pytest.raises(ConfigError, match="another model"):
        create_app(config, index=wrong)


def test_index_add_refuses_a_runs_items_under_the_other_kind_of_id(tmp_path_factory, data_root, tmp_path, run_cli):
    # an index of a run's .npz (ids: file paths) took the same run's shards (ids: dataset rows)
    # with --add, and the other way round: 200 duplicates under new ids, every query answered
    # with each image twice
    import numpy as np

    from dmlkit.embedding_shards import write_shards
    from test_service import trained_run

    npz = trained_run(tmp_path_factory, data_root) / "embeddings" / "test.npz"
    z = np.load(npz)
    shards = tmp_path / "test-shards"
    write_shards(shards, z["embeddings"], z["labels"], z["indices"])
    for first, second in ((npz, shards), (shards, npz)):
        index = tmp_path / f"idx-{first.stem}"
        code, _, err = run_cli(["index", str(first), "-o", str(index), "--data-root", str(data_root)])
        assert code == 0, err
        code, out, err = run_cli(["index", str(second), "-o", str(index), "--add", "--data-root", str(data_root)])
        assert code == 2 and "indexed twice" in err and len(err.strip().splitlines()) == 1
        assert json.loads((index / "index.json").read_text())["count"] == 200


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_save_killed_between_its_renames_loses_no_index(tmp_path):
    # save_index renames the old folder aside, then the new one into place: a kill between the
    # two left no index at the path ("index not found"), the data only in hidden folders
    import numpy as np

    from dmlkit.apps import EmbeddingIndex

    rng = np.random.default_rng(0)
    old_x, new_x = rng.normal(size=(20, 4)).astype(np.float32), rng.normal(size=(30, 4)).astype(np.float32)
    path = tmp_path / "idx"
    EmbeddingIndex(old_x).save(path)
    EmbeddingIndex(new_x).save(tmp_path / "new")
    dead = _dead_pid()
    path.rename(tmp_path / f".idx.old-{dead}")  # the kill: old aside, new complete beside it
    (tmp_path / "new").rename(tmp_path / f".idx.tmp-{dead}")
    assert len(EmbeddingIndex.load(path)) == 30  # the new one, put in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]

    path.rename(tmp_path / f".idx.old-{dead}")  # killed before the new one was complete
    (tmp_path / f".idx.tmp-{dead}").mkdir()
    (tmp_path / f".idx.tmp-{dead}" / "vectors.npy").write_bytes(b"half")
    assert len(EmbeddingIndex.load(path)) == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]

    EmbeddingIndex(old_x).save(path)  # a save sweeps what killed saves left
    (tmp_path / f".idx.old-{dead}").mkdir()
    EmbeddingIndex(new_x).save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]
