"""``dmlkit reid`` on embedding files, the combined re-id loss, and the report's re-id figures."""

from __future__ import annotations

import json

import matplotlib
import numpy as np
import pytest
import torch

from dmlkit.apps.reid import evaluate_reid
from dmlkit.cli import main
from dmlkit.embeddings import save_embeddings
from dmlkit.losses import get_loss
from dmlkit.report import figures


def run(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture()
def reid_files(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(12), 6)
    cams = np.tile(np.arange(3), 24)
    emb = (rng.normal(size=(12, 8))[ids] + 0.8 * rng.normal(size=(72, 8))).astype(np.float32)
    groups = np.where(np.arange(72) % 6 == 0, "query", "gallery")
    save_embeddings(tmp_path / "all.npz", emb, ids, cams=cams, groups=groups)
    q, g = groups == "query", groups == "gallery"
    save_embeddings(tmp_path / "q.npz", emb[q], ids[q], cams=cams[q])
    save_embeddings(tmp_path / "g.npz", emb[g], ids[g], cams=cams[g])
    want = evaluate_reid(emb[q], emb[g], ids[q], ids[g], cams[q], cams[g])
    return tmp_path, want


def test_cli_json_matches_the_api(reid_files, capsys):
    tmp, want = reid_files
    code, out, _ = run(["reid", str(tmp / "all.npz"), "--json", "-o", str(tmp / "r.json")], capsys)
    assert code in (0, None)
    got = json.loads(out)
    assert got["rank_1"] == pytest.approx(want.rank(1)) and got["map"] == pytest.approx(want.mAP)
    assert got["minp"] == pytest.approx(want.mINP) and got["num_valid_queries"] == 12
    saved = json.loads((tmp / "r.json").read_text())
    assert len(saved["cmc"]) == 60 and len(saved["examples"]) == 8
    assert set(saved["examples"][0]["status"]) <= {"positive", "negative", "junk"}
    code, out2, _ = run(["reid", str(tmp / "q.npz"), "--gallery", str(tmp / "g.npz"), "--json"],
                        capsys)
    assert json.loads(out2)["map"] == pytest.approx(want.mAP)


def test_two_files_with_identity_names_share_one_code_table(tmp_path, capsys):
    """Each file codes its names against its own sorted table: the gallery holds a person the
    queries do not ('alice'), so 'bob' is code 0 in one file and 1 in the other."""
    rng = np.random.default_rng(0)
    people = np.array(["alice", "bob", "carol", "dave"])
    g_ids, q_ids = np.repeat(np.arange(4), 3), np.array([1, 2, 3, 1, 2, 3])
    centres = 3 * rng.normal(size=(4, 8))
    g = (centres[g_ids] + rng.normal(size=(12, 8))).astype(np.float32)
    q = (centres[q_ids] + rng.normal(size=(6, 8))).astype(np.float32)
    g_cams, q_cams = np.tile([1, 2, 3], 4), np.zeros(6, int)
    save_embeddings(tmp_path / "q.npz", q, people[q_ids], cams=q_cams)
    save_embeddings(tmp_path / "g.npz", g, people[g_ids], cams=g_cams)
    want = evaluate_reid(q, g, q_ids, g_ids, q_cams, g_cams)
    code, out, _ = run(["reid", str(tmp_path / "q.npz"), "--gallery", str(tmp_path / "g.npz"),
                        "--examples", "2", "--json", "-o", str(tmp_path / "r.json")], capsys)
    assert code in (0, None)
    got = json.loads(out)
    assert want.mAP > 0.9 and got["map"] == pytest.approx(want.mAP)
    assert got["rank_1"] == pytest.approx(want.rank(1))
    example = json.loads((tmp_path / "r.json").read_text())["examples"][0]
    assert example["query_id"] in ("bob", "carol", "dave")
    groups = np.r_[["query"] * 6, ["gallery"] * 12]  # one file: its own names in the examples
    save_embeddings(tmp_path / "all.npz", np.r_[q, g], people[np.r_[q_ids, g_ids]],
                    cams=np.r_[q_cams, g_cams], groups=groups)
    code, out, _ = run(["reid", str(tmp_path / "all.npz"), "--examples", "2", "--json", "-o",
                        str(tmp_path / "r1.json")], capsys)
    assert code in (0, None) and json.loads(out)["map"] == pytest.approx(want.mAP)
    assert json.loads((tmp_path / "r1.json").read_text())["examples"][0]["query_id"] in ("bob", "carol", "dave")
    save_embeddings(tmp_path / "g_ids.npz", g, g_ids, cams=g_cams)
    code, _, err = run(["reid", str(tmp_path / "q.npz"), "--gallery", str(tmp_path / "g_ids.npz")],
                       capsys)
    assert code == 2 and "names" in err and "Traceback" not in err


def test_cli_table_rerank_and_errors(reid_files, capsys):
    tmp, want = reid_files
    code, out, _ = run(["reid", str(tmp / "all.npz"), "--rerank", "--k1", "5", "--k2", "2"], capsys)
    assert code in (0, None)
    assert "Rank-1" in out and "mAP" in out and "re-ranked" in out and "re-ranking (k1=5" in out
    code, _, err = run(["reid", str(tmp / "q.npz")], capsys)  # no groups, no --gallery
    assert code == 2 and "--gallery" in err
    code, _, err = run(["reid", str(tmp / "all.npz"), "--ap-mode", "bogus"], capsys)
    assert code == 2


def test_cli_camera_ids_and_row_arrays_must_fit(reid_files, capsys, tmp_path):
    """Camera ids on one side only switched the same-camera rule off without a word (Rank-1 1.0
    instead of 0.5); a 'cams' or 'groups' array of another length was a traceback; and the
    examples of --no-camera-rule marked as junk the items its metrics counted as positives."""
    tmp, _ = reid_files
    d = np.load(tmp / "all.npz")
    fields = {k: d[k] for k in d.files}
    q = fields["groups"] == "query"
    save_embeddings(tmp_path / "q_nocams.npz", fields["embeddings"][q], fields["labels"][q])
    code, _, err = run(["reid", str(tmp_path / "q_nocams.npz"), "-g", str(tmp / "g.npz")], capsys)
    assert code == 2 and "camera ids for both query and gallery" in err
    for name in ("cams", "groups"):
        short = dict(fields, **{name: fields[name][:-1]})
        save_embeddings(tmp_path / f"short_{name}.npz", short.pop("embeddings"), short.pop("labels"),
                        **{k: v for k, v in short.items() if k in ("cams", "groups")})
        code, _, err = run(["reid", str(tmp_path / f"short_{name}.npz")], capsys)
        assert code == 2 and f"'{name}' has 71 values for 72 embeddings" in err, err
    code, _, _ = run(["reid", str(tmp / "all.npz"), "--no-camera-rule", "--examples", "12", "-o",
                      str(tmp_path / "ex.json")], capsys)
    assert code in (0, None)
    for e in json.loads((tmp_path / "ex.json").read_text())["examples"]:
        assert all((s == "positive") == (gid == e["query_id"]) for s, gid in zip(e["status"], e["gallery_ids"]))
        assert "junk" not in e["status"]  # no -1 ids here: junk only came from the camera rule


def test_vehicleid_protocol_from_a_file(tmp_path, capsys):
    rng = np.random.default_rng(1)
    ids = np.repeat(np.arange(20), 5)
    emb = (rng.normal(size=(20, 6))[ids] + 0.5 * rng.normal(size=(100, 6))).astype(np.float32)
    save_embeddings(tmp_path / "v.npz", emb, ids, groups=np.full(100, "test"))
    code, out, _ = run(["reid", str(tmp_path / "v.npz"), "--repeats", "3", "--ranks", "1",
                        "--ranks", "5", "--json"], capsys)  # repeated: the ranks add up
    assert code in (0, None)
    res = json.loads(out)
    assert res["protocol"] == "vehicleid" and len(res["recall_at_1"]["values"]) == 3
    assert res["recall_at_1"]["mean"] <= res["recall_at_5"]["mean"]


def test_combined_loss_recipe_trains():
    torch.manual_seed(0)
    loss_fn = get_loss("combined", num_classes=4, embedding_size=6, losses=[
        {"name": "triplet", "params": {"margin": 0.3, "reduction": "batch_hard"}},
        {"name": "softmax", "weight": 0.5, "bn_neck": True, "params": {"bias": False}},
    ])
    x = torch.randn(16, 6, requires_grad=True)
    y = torch.arange(16) % 4
    value = loss_fn(x, y)
    parts = loss_fn.last_terms
    assert value.item() == pytest.approx(parts["0:triplet"] + 0.5 * parts["1:softmax"], rel=1e-5)
    value.backward()
    assert x.grad is not None and loss_fn.terms[1].weight.grad is not None
    assert not loss_fn.necks[1].bias.requires_grad  # BNNeck: no shift
    with pytest.raises(ValueError):
        get_loss("combined", num_classes=4, embedding_size=6, losses=[{"name": "nope"}])
    with pytest.raises(ValueError):
        get_loss("combined", num_classes=4, embedding_size=6, losses=[])


def test_report_figures(tmp_path):
    matplotlib.use("Agg")
    fig = figures.cmc_curve({"plain": [0.5, 0.7, 1.0], "re-ranked": [0.6, 0.8, 1.0]})
    assert len(fig.axes[0].lines) == 2
    ex = [{"query_id": 3, "gallery_ids": [3, 3, 5], "status": ["junk", "positive", "negative"]}]
    fig = figures.reid_strip(ex)
    assert len(fig.axes) == 4
    assert [s.get_edgecolor() for s in (fig.axes[1].spines["top"],)] != \
        [s.get_edgecolor() for s in (fig.axes[2].spines["top"],)]


def _market_fixture(root):
    from PIL import Image

    rng = np.random.default_rng(0)
    base = root / "Market-1501-v15.09.15"
    patterns = rng.integers(0, 255, (20, 4, 2))  # one coarse pattern per identity

    def save(folder, pid, cam, k):
        img = np.kron(patterns[pid], np.ones((8, 8))) + rng.normal(0, 20, (32, 16))
        path = base / folder / f"{pid:04d}_c{cam}s1_{k:06d}_00.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).convert("RGB").save(path)

    for pid in range(1, 11):
        for k in range(4):
            save("bounding_box_train", pid, 1 + k % 2, k)
    for pid in range(11, 17):
        save("query", pid, 1, 100)
        for k in range(3):
            save("bounding_box_test", pid, 1 + k, 200 + k)  # camera 1 = junk for the query


def _market_config(root, name: str, *, batches: int, model: dict, loss: dict) -> dict:
    """A one-epoch grayscale small-CNN run on :func:`_market_fixture`'s data under ``root``."""
    return {
        "name": name, "seed": 0,
        "data": {"dataset": "market1501", "root": str(root), "options": {"strict": False},
                 "split": {"kind": "default", "val_fraction": 0.2}, "transform": "grayscale",
                 "image_size": 28},
        "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1, **model},
        "loss": loss, "miner": None,
        "sampler": {"classes_per_batch": 4, "samples_per_class": 2, "batches_per_epoch": batches},
        "optimizer": {"preset": "cpu_quick"},
        "training": {"epochs": 1, "device": "cpu"},
    }


def test_train_with_the_recipe_then_evaluate_the_run(tmp_path, capsys):
    import warnings

    from dmlkit.training import train

    _market_fixture(tmp_path)
    config = _market_config(tmp_path, "reid_smoke", batches=3, model={"embedding_size": 16, "freeze_batchnorm": False},
                            loss={"name": "combined", "params": {"losses": [
                                {"name": "triplet", "params": {"margin": 0.3, "reduction": "batch_hard"}},
                                {"name": "softmax", "bn_neck": True, "params": {"bias": False}}]}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(config, tmp_path / "run", progress=False)
        code, out, err = run(["reid", str(tmp_path / "run"), "--json"], capsys)
    assert code in (0, None), err
    res = json.loads(out)
    assert res["num_queries"] == 6 and res["num_valid_queries"] == 6 and res["num_gallery"] == 18
    saved = json.loads((tmp_path / "run" / "reid.json").read_text())
    assert saved["examples"][0]["query_path"].endswith(".jpg")
    assert "junk" in {s for e in saved["examples"] for s in e["status"]}


def test_a_run_s_saved_embeddings_are_reused_only_for_the_files_they_embedded(tmp_path, capsys, monkeypatch):
    import warnings

    import dmlkit.training
    from dmlkit.training import train

    _market_fixture(tmp_path)
    config = _market_config(tmp_path, "reid_reuse", batches=1, model={"embedding_size": 8},
                            loss={"name": "triplet", "params": {"margin": 0.3}})
    embedded = []
    real = dmlkit.training.embed_split
    monkeypatch.setattr(dmlkit.training, "embed_split", lambda *a, **k: embedded.append(1) or real(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(config, tmp_path / "run", progress=False)
        embedded.clear()
        assert run(["reid", str(tmp_path / "run"), "--json"], capsys)[0] in (0, None)
        assert embedded == []  # the saved test.npz: the same files
        gallery = tmp_path / "Market-1501-v15.09.15" / "bounding_box_test"
        # same identity, camera, count and order of rows: only the file is another one
        (gallery / "0011_c2s1_000201_00.jpg").rename(gallery / "0011_c2s1_000201_01.jpg")
        assert run(["reid", str(tmp_path / "run"), "--json"], capsys)[0] in (0, None)
    assert embedded == [1]  # was: the saved rows reused for another file
