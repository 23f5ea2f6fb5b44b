"""Re-id dataset readers on small fixtures in the official layouts, and the VehicleID protocol."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmlkit.apps.reid import draw_gallery, evaluate_reid, vehicleid_protocol
from dmlkit.data import ReidDataset, default_split, load_dataset
from dmlkit.data.reid import MSMT17_TEST_OFFSET, parse_reid_name
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError


def _img(path: Path, value: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 4, 3), value, dtype=np.uint8)).save(path)


def _market(root: Path, folder: str = "Market-1501-v15.09.15") -> Path:
    base = root / folder
    for name in ("0002_c1s1_000451_03.jpg", "0002_c2s1_000551_01.jpg", "0007_c3s3_000012_02.jpg"):
        _img(base / "bounding_box_train" / name)
    for name in ("0011_c1s1_001051_00.jpg", "0012_c4s2_000201_00.jpg"):
        _img(base / "query" / name)
    for name in ("0011_c1s1_001151_01.jpg", "0011_c2s1_001151_01.jpg", "-1_c1s1_000401_03.jpg",
                 "0000_c3s1_000001_01.jpg", "0012_c5s2_000301_02.jpg"):
        _img(base / "bounding_box_test" / name)
    (base / "bounding_box_test" / "Thumbs.db").write_bytes(b"x")  # ignored: not an image
    return base


def test_parse_names():
    assert parse_reid_name("0002_c1s1_000451_03.jpg") == (2, 0)
    assert parse_reid_name("-1_c6s2_000001_01.jpg") == (-1, 5)
    assert parse_reid_name("0001_c2_f0046182.jpg") == (1, 1)
    assert parse_reid_name("0002_c002_00030600_0.jpg") == (2, 1)
    with pytest.raises(DataError, match="<id>_c<camera>"):
        parse_reid_name("image.jpg")


def test_market1501_layout_groups_cams_and_split(tmp_path):
    _market(tmp_path)
    with pytest.warns(UserWarning, match="official release"):
        ds = load_dataset("market1501", tmp_path)
    assert isinstance(ds, ReidDataset) and len(ds) == 10
    q, g = ds.subset_group("query"), ds.subset_group("gallery")
    assert q.labels.tolist() == [11, 12] and q.cams.tolist() == [0, 3]
    assert sorted(g.labels.tolist()) == [-1, 0, 11, 11, 12]
    assert isinstance(g, ReidDataset) and g.cams.shape == (5,)
    split = default_split(ds)
    assert list(split.train) == [2, 7] and 11 in split.test and -1 in split.test
    x, y = ds[0]
    assert x.shape == (3, 8, 4) and y == 2
    # the protocol on the dataset's own ids and cameras: query 11 (cam 0) keeps one positive
    emb = np.eye(10, dtype=np.float32)
    r = evaluate_reid(emb[:2], emb[:5], q.labels, g.labels, q.cams, g.cams)
    assert r.num_positives.tolist() == [1, 1]


def test_duke_and_cuhk03_share_the_market_layout(tmp_path):
    _market(tmp_path, "DukeMTMC-reID")
    _market(tmp_path, "cuhk03-np/labeled")
    with pytest.warns(UserWarning):
        duke = load_dataset("dukemtmc_reid", tmp_path)
    with pytest.warns(UserWarning):
        cuhk = load_dataset("cuhk03", tmp_path, variant="labeled")
    assert len(duke) == len(cuhk) == 10 and cuhk.meta["variant"] == "labeled"
    with pytest.raises(DataNotFoundError, match="cuhk03-np/detected"):
        load_dataset("cuhk03", tmp_path)
    with pytest.raises(ConfigError):
        load_dataset("cuhk03", tmp_path, variant="both")


def test_strict_counts_and_missing(tmp_path):
    with pytest.raises(DataNotFoundError, match="Market-1501-v15.09.15"):
        load_dataset("market1501", tmp_path)
    _market(tmp_path)
    with pytest.raises(DataError, match="official release has 12,936"):
        load_dataset("market1501", tmp_path, strict=True)


def test_msmt17_lists_cameras_and_disjoint_ids(tmp_path):
    base = tmp_path / "MSMT17_V1"
    lists = {
        "list_train.txt": ["0000/0000_000_01_0303morning_0015_0.jpg 0",
                           "0000/0000_001_05_0303morning_0016_0.jpg 0"],
        "list_val.txt": ["0001/0001_000_02_0303noon_0001_1.jpg 1"],
        "list_query.txt": ["0000/0000_000_15_0303afternoon_0001_0.jpg 0"],
        "list_gallery.txt": ["0000/0000_003_07_0303afternoon_0002_0.jpg 0",
                             "0002/0002_000_15_0303afternoon_0009_1.jpg 2"],
    }
    for name, rows in lists.items():
        (base).mkdir(parents=True, exist_ok=True)
        (base / name).write_text("\n".join(rows) + "\n")
        sub = "train" if name in ("list_train.txt", "list_val.txt") else "test"
        for row in rows:
            _img(base / sub / row.split()[0])
    with pytest.warns(UserWarning):
        ds = load_dataset("msmt17", tmp_path)
    assert ds.sample_groups.tolist().count("train") == 3
    q = ds.subset_group("query")
    assert q.labels.tolist() == [MSMT17_TEST_OFFSET] and q.cams.tolist() == [14]
    assert ds.class_names[MSMT17_TEST_OFFSET] == "test/0000" and ds.class_names[0] == "train/0000"
    assert ds.class_groups[0] == "train" and ds.class_groups[MSMT17_TEST_OFFSET] == "test"
    x, _ = q[0]
    assert x.shape[0] == 3
    with pytest.warns(UserWarning):
        no_val = load_dataset("msmt17", tmp_path, include_val=False)
    assert no_val.sample_groups.tolist().count("train") == 2
    (base / "list_query.txt").write_text("0000/broken.jpg\n")
    with pytest.raises(DataError, match="malformed"):
        load_dataset("msmt17", tmp_path)


def test_veri776_name_lists(tmp_path):
    base = tmp_path / "VeRi"
    files = {"train": ["0001_c001_00016450_0.jpg", "0001_c002_00016455_0.jpg"],
             "query": ["0002_c002_00030600_0.jpg"],
             "test": ["0002_c003_00084280_0.jpg", "0002_c002_00030605_0.jpg"]}
    for split, names in files.items():
        base.mkdir(parents=True, exist_ok=True)
        (base / f"name_{split}.txt").write_text("\n".join(names) + "\n")
        for n in names:
            _img(base / f"image_{split}" / n)
    with pytest.warns(UserWarning):
        ds = load_dataset("veri776", tmp_path)
    g = ds.subset_group("gallery")
    assert g.labels.tolist() == [2, 2] and g.cams.tolist() == [2, 1]
    assert Path(g.paths[0]).parent.name == "image_test"


def _vehicleid(root: Path) -> Path:
    base = root / "VehicleID_V1.0"
    split = base / "train_test_split"
    split.mkdir(parents=True)
    train = [f"{i:07d} {i // 3}" for i in range(6)]
    test = [f"{100 + i:07d} {100 + i // 4}" for i in range(4 * 800)]
    (split / "train_list.txt").write_text("\n".join(train) + "\n")
    (split / "test_list_800.txt").write_text("\n".join(test) + "\n")
    for row in train + test[:8]:
        _img(base / "image" / f"{row.split()[0]}.jpg")
    return base


def test_vehicleid_lists(tmp_path):
    _vehicleid(tmp_path)
    ds = load_dataset("vehicleid", tmp_path, test_size=800, strict=True)
    test = ds.subset_group("test")
    assert len(test) == 3200 and test.num_classes == 800 and ds.meta["test_size"] == 800
    assert (ds.cams == 0).all()
    assert ds[0][0].shape == (3, 8, 4)
    with pytest.raises(ConfigError):
        load_dataset("vehicleid", tmp_path, test_size=1000)
    with pytest.raises(DataNotFoundError, match="test_list_1600"):
        load_dataset("vehicleid", tmp_path, test_size=1600)


def test_draw_gallery_one_per_identity():
    ids = np.array([5, 5, 5, 7, 9, 9])
    masks = [draw_gallery(ids, np.random.default_rng(s)) for s in range(20)]
    for m in masks:
        assert sorted(ids[m].tolist()) == [5, 7, 9]
    assert len({tuple(m) for m in masks}) > 1  # the draw is random


def test_vehicleid_protocol_matches_a_plain_computation():
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(40), 4)
    emb = np.eye(40)[ids] + 0.8 * rng.standard_normal((160, 40))
    res = vehicleid_protocol(emb, ids, repeats=3, seed=1, ks=(1, 5))
    for r in range(3):
        gal = draw_gallery(ids, np.random.default_rng([1, r]))
        d = ((emb[~gal][:, None] - emb[gal][None]) ** 2).sum(-1)
        rank = np.argsort(d, axis=1, kind="stable")
        hit = ids[gal][rank] == ids[~gal][:, None]
        first = hit.argmax(1)
        assert res.values[1][r] == pytest.approx(np.mean(first < 1))
        assert res.values[5][r] == pytest.approx(np.mean(first < 5))
    d = res.to_dict()
    assert d["recall_at_1"]["mean"] == pytest.approx(np.mean(res.values[1]))
    assert d["recall_at_5"]["std"] == pytest.approx(np.std(res.values[5]))
    assert d["num_queries"] == 120 and d["num_identities"] == 40 and d["repeats"] == 3
    assert 0 < d["recall_at_1"]["mean"] <= d["recall_at_5"]["mean"] <= 1
    with pytest.raises(DataError):
        vehicleid_protocol(np.eye(3), [1, 2, 3])
