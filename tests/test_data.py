"""dmlkit.data: datasets (real data + tiny real-format fixtures), splits and transforms."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dmlkit.data import (
    ArrayDataset,
    ClassSplit,
    ImageFileDataset,
    MetricDataset,
    default_split,
    fold_split,
    get_transforms,
    kfold_class_partitions,
    load_dataset,
    split_classes,
)
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError

# -- helpers -----------------------------------------------------------------------------------


def _jpeg(path: Path, seed: int, size=(40, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format="JPEG")


@pytest.fixture(scope="module")
def omniglot(data_root):
    return load_dataset("omniglot", root=data_root)


# -- real data -------------------------------------------------------------------------------------


def test_omniglot_counts_groups_and_names(omniglot):
    ds = omniglot
    assert isinstance(ds, MetricDataset) and len(ds) == (964 + 659) * 20
    assert ds.labels.dtype == np.int64 and ds.num_classes == 1623
    assert np.array_equal(ds.classes, np.arange(1623))
    assert set(ds.class_counts().values()) == {20}
    groups = np.array([ds.class_groups[c] for c in range(1623)])
    assert (groups[:964] == "background").all() and (groups[964:] == "evaluation").all()
    assert ds.class_names[0] == "Arcadian/character01"
    assert ds.class_names[964] == "Angelic/character01"
    x, y = ds[0]
    assert x.shape == (1, 105, 105) and x.dtype == torch.float32 and y == 0
    # ink is white (about 8 % of the pixels), background black
    assert 0.02 < float(x.mean()) < 0.2 and set(torch.unique(x).tolist()) == {0.0, 1.0}
    split = default_split(ds)
    assert split.sizes == {"train": 964, "val": 0, "test": 659}
    assert split.train == tuple(range(964)) and split.test == tuple(range(964, 1623))
    assert ds.thumbnail(0, size=32).size == (32, 32)


def test_omniglot_official_zip_matches_npz(omniglot, data_root):
    z = load_dataset("omniglot", root=data_root, source="zip", sets=["evaluation"])
    ev = omniglot.subset_group("evaluation")
    assert np.array_equal(z.labels, ev.labels)
    assert z.class_names[964] == ev.class_names[964]
    for i in (0, 1, 4999, 13179):
        assert torch.equal(z[i][0], ev[i][0])


def test_omniglot_missing_source_message(data_root):
    with pytest.raises(DataNotFoundError, match="images_evaluation"):
        load_dataset("omniglot", root=data_root, source="folder", sets=["evaluation"])


def test_att_faces(data_root):
    ds = load_dataset("att_faces", root=data_root)
    assert isinstance(ds, ImageFileDataset) and len(ds) == 400 and ds.num_classes == 40
    assert ds.classes.tolist() == list(range(1, 41))
    assert set(ds.class_counts().values()) == {10}
    assert ds.paths[0].endswith("s1/1.pgm")
    x, y = ds[15]
    assert x.shape == (1, 112, 92) and y == 2
    split = default_split(ds)
    assert split.train == tuple(range(1, 21)) and split.test == tuple(range(21, 41))
    rgb = ds.with_transform(get_transforms("imagenet", train=False, image_size=224))
    assert rgb[0][0].shape == (3, 224, 224)


def test_binary_alphadigits(data_root):
    ds = load_dataset("binary_alphadigits", root=data_root)
    assert len(ds) == 36 * 39 and ds.num_classes == 36
    assert set(ds.class_counts().values()) == {39}
    assert ds.class_names[0] == "0" and ds.class_names[10] == "A" and ds.class_names[35] == "Z"
    assert ds[0][0].shape == (1, 20, 16)
    assert default_split(ds).sizes == {"train": 18, "val": 0, "test": 18}


def test_checksum_mismatch_is_reported(tmp_path, data_root):
    folder = tmp_path / "binary_alphadigits"
    folder.mkdir()
    (folder / "binaryalphadigs.mat").write_bytes(b"not the real file")
    with pytest.raises(DataError, match="checksum mismatch"):
        load_dataset("binary_alphadigits", root=tmp_path)


# -- dataset views ----------------------------------------------------------------------------------


def test_subset_classes_views_and_fingerprint():
    data = np.arange(6 * 4 * 4, dtype=np.uint8).reshape(6, 4, 4)
    ds = ArrayDataset(data, [5, 5, 7, 7, 9, 9], class_names={5: "a", 7: "b", 9: "c"},
                      class_groups={5: "train", 7: "train", 9: "test"},
                      split_groups={"train": "train", "test": "test"}, name="toy")
    sub = ds.subset_classes([9, 5])
    assert sub.labels.tolist() == [5, 5, 9, 9] and sub.classes.tolist() == [5, 9]
    assert sub.class_names == {5: "a", 9: "c"} and sub.class_groups == {5: "train", 9: "test"}
    assert np.allclose(sub[2][0].numpy(), data[4][None] / 255.0)
    assert sub.fingerprint() != ds.fingerprint()
    assert sub.fingerprint() == ds.subset_classes([5, 9]).fingerprint()
    assert ds.with_transform(lambda im: 1).fingerprint() == ds.fingerprint()
    assert ds.with_transform(lambda im: 1)[0][0] == 1 and ds.transform is None
    nested = sub.subset([3, 0])
    assert nested.labels.tolist() == [9, 5] and np.array_equal(nested.arrays, data[[5, 0]])
    with pytest.raises(DataError, match="not in dataset"):
        ds.subset_classes([5, 11])
    with pytest.raises(IndexError):
        ds[6]


def test_feature_array_dataset():
    feats = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    ds = ArrayDataset(feats, [1, 1, 2, 2, 3], kind="features")
    x, y = ds[4]
    assert torch.allclose(x, torch.from_numpy(feats[4])) and y == 3
    assert ds.paths is None
    with pytest.raises(DataError):
        ds.thumbnail(0)


# -- file-backed datasets: tiny real-format fixtures ------------------------------------------------


def _cub(root: Path) -> Path:
    folder = root / "CUB_200_2011"
    classes = [(1, "001.Black_footed_Albatross"), (2, "002.Laysan_Albatross"),
               (101, "101.White_Pelican"), (102, "102.Western_Wood_Pewee")]
    images, labels = [], []
    k = 1
    for cid, cname in classes:
        for j in range(2):
            rel = f"{cname}/{cname.split('.')[1]}_{j:04d}.jpg"
            _jpeg(folder / "images" / rel, k)
            images.append(f"{k} {rel}")
            labels.append(f"{k} {cid}")
            k += 1
    (folder / "images.txt").write_text("\n".join(images) + "\n")
    (folder / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (folder / "classes.txt").write_text("\n".join(f"{c} {n}" for c, n in classes) + "\n")
    return folder


def test_cub200_fixture(tmp_path):
    _cub(tmp_path)
    with pytest.warns(UserWarning, match="official release has 11,788"):
        ds = load_dataset("cub200", root=tmp_path)
    assert len(ds) == 8 and ds.classes.tolist() == [1, 2, 101, 102]
    assert ds.class_names[101] == "101.White_Pelican"
    split = default_split(ds)
    assert split.train == (1, 2) and split.test == (101, 102)
    x, y = ds.with_transform(get_transforms("imagenet", train=True))[5]
    assert x.shape == (3, 227, 227) and y == 101
    with pytest.raises(DataError, match="official release"):
        load_dataset("cub200", root=tmp_path, strict=True)


def test_cars196_fixture(tmp_path):
    import scipy.io

    folder = tmp_path / "cars196"
    annos = []
    for k, cls in enumerate([1, 1, 98, 99, 196, 196], start=1):
        rel = f"car_ims/{k:06d}.jpg"
        _jpeg(folder / rel, k)
        annos.append((rel, 0, 0, 10, 10, cls, int(cls > 98)))
    dtype = [("relative_im_path", "O"), ("bbox_x1", "O"), ("bbox_y1", "O"), ("bbox_x2", "O"),
             ("bbox_y2", "O"), ("class", "O"), ("test", "O")]
    arr = np.array(annos, dtype=dtype)
    names = np.array([f"Car {i}" for i in range(1, 197)], dtype=object)
    scipy.io.savemat(folder / "cars_annos.mat", {"annotations": arr, "class_names": names})
    with pytest.warns(UserWarning):
        ds = load_dataset("cars196", root=tmp_path)
    assert ds.labels.tolist() == [1, 1, 98, 99, 196, 196]
    assert ds.class_names[99] == "Car 99"
    split = default_split(ds)
    assert split.train == (1, 98) and split.test == (99, 196)
    assert ds[0][0].shape == (3, 30, 40)


def test_sop_fixture(tmp_path):
    folder = tmp_path / "Stanford_Online_Products"
    header = "image_id class_id super_class_id path\n"
    train = [(1, 1, 1, "bicycle_final/111_0.JPG"), (2, 1, 1, "bicycle_final/111_1.JPG"),
             (3, 2, 2, "cabinet_final/222_0.JPG"), (4, 2, 2, "cabinet_final/222_1.JPG")]
    test = [(5, 11319, 1, "bicycle_final/333_0.JPG"), (6, 11319, 1, "bicycle_final/333_1.JPG")]
    for rows, name in ((train, "Ebay_train.txt"), (test, "Ebay_test.txt")):
        for r in rows:
            _jpeg(folder / r[3], r[0])
        (folder / name).write_text(header + "".join(" ".join(map(str, r)) + "\n" for r in rows))
    with pytest.warns(UserWarning):
        ds = load_dataset("sop", root=tmp_path)
    assert ds.classes.tolist() == [1, 2, 11319]
    assert ds.class_names[2] == "cabinet/2"
    split = default_split(ds)
    assert split.train == (1, 2) and split.test == (11319,)
    (folder / "bicycle_final/333_1.JPG").unlink()
    with pytest.raises(DataNotFoundError, match="333_1.JPG"):
        load_dataset("sop", root=tmp_path)


def test_inshop_fixture(tmp_path):
    folder = tmp_path / "InShop"
    rows = [("img/WOMEN/Dresses/id_00000002/02_1_front.jpg", "id_00000002", "train"),
            ("img/WOMEN/Dresses/id_00000002/02_2_side.jpg", "id_00000002", "train"),
            ("img/MEN/Denim/id_00000080/01_1_front.jpg", "id_00000080", "query"),
            ("img/MEN/Denim/id_00000080/01_2_side.jpg", "id_00000080", "gallery"),
            ("img/MEN/Denim/id_00000081/01_1_front.jpg", "id_00000081", "query"),
            ("img/MEN/Denim/id_00000081/01_3_back.jpg", "id_00000081", "gallery")]
    for k, (rel, _, _) in enumerate(rows):
        _jpeg(folder / rel, k)
    (folder / "Eval").mkdir()
    (folder / "Eval" / "list_eval_partition.txt").write_text(
        f"{len(rows)}\nimage_name item_id evaluation_status\n"
        + "".join(f"{r} {i} {s}\n" for r, i, s in rows))
    with pytest.warns(UserWarning):
        ds = load_dataset("inshop", root=tmp_path)
    assert ds.labels.tolist() == [2, 2, 80, 80, 81, 81]
    split = default_split(ds)
    assert split.train == (2,) and split.test == (80, 81)
    query, gallery = ds.subset_group("query"), ds.subset_group("gallery")
    assert query.labels.tolist() == [80, 81] and gallery.labels.tolist() == [80, 81]
    assert query.paths[0].endswith("id_00000080/01_1_front.jpg")


def _image_folder(root: Path, n_classes=4, per_class=3) -> Path:
    for c in range(n_classes):
        for j in range(per_class):
            _jpeg(root / f"class_{c}" / f"{j}.jpg", 10 * c + j)
    return root


def test_image_folder_and_corrupt_images(tmp_path):
    root = _image_folder(tmp_path / "folder")
    ds = load_dataset("image_folder", root=root)
    assert len(ds) == 12 and ds.class_names == {0: "class_0", 1: "class_1", 2: "class_2", 3: "class_3"}
    assert default_split(ds).sizes == {"train": 2, "val": 0, "test": 2}
    bad = root / "class_1" / "1.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    ds = load_dataset("image_folder", root=root)
    with pytest.raises(DataError, match=r"class_1/1\.jpg"):
        ds[4]
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        ok = load_dataset("image_folder", root=root, skip_corrupt=True)
    assert len(ok) == 11 and ok.skipped == [str(bad)]
    assert all(ok[i][0].shape == (3, 30, 40) for i in range(len(ok)))
    # rows are positions: a run's `indices` (dataset_rows) name the right files after a skip
    from dmlkit.embeddings import dataset_rows

    test = ok.subset_classes([1, 2])
    rows = dataset_rows(test)
    assert [ok.paths[r] for r in rows] == test.paths and str(bad) not in test.paths


def test_image_folder_skips_hidden_entries_everywhere_and_follows_linked_folders(tmp_path):
    """Copies under class/.ipynb_checkpoints/ were loaded as images (exact duplicates: P@1 up
    5 points), macOS ._x.jpg forks too; a symlinked sub-folder of a class was skipped."""
    import os
    import shutil

    root = _image_folder(tmp_path / "folder")
    shutil.copytree(root / "class_0", root / "class_0" / ".ipynb_checkpoints")
    (root / "class_0" / "._0.jpg").write_bytes(b"\0\5\x16\x07 AppleDouble")
    shutil.copytree(root / "class_1", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / "class_2" / "more")
    os.symlink(root / "class_2", root / "class_2" / "loop")  # a link back up: visited once
    ds = load_dataset("image_folder", root=root)
    assert ds.class_counts() == {0: 3, 1: 3, 2: 6, 3: 3}
    with pytest.raises(ConfigError, match="extensions must be a list"):
        load_dataset("image_folder", root=root, extensions="jpg")
    assert len(load_dataset("image_folder", root=root, extensions=["JPG"])) == 15


def test_exif_orientation_is_applied(tmp_path):
    from PIL import Image

    from dmlkit.data import load_image

    img = Image.fromarray(np.arange(6 * 4 * 3, dtype=np.uint8).reshape(4, 6, 3))  # 6 wide, 4 high
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned: shown rotated by 90 degrees
    img.save(tmp_path / "phone.jpg", exif=exif)
    assert load_image(tmp_path / "phone.jpg").size == (4, 6)
    img.save(tmp_path / "plain.jpg")
    assert load_image(tmp_path / "plain.jpg").size == (6, 4)


def test_csv_dataset(tmp_path):
    _image_folder(tmp_path / "imgs")
    lines = ["path,label,split"]
    for c, split in enumerate(["train", "train", "val", "test"]):
        lines += [f"class_{c}/{j}.jpg,bird{c},{split}" for j in range(3)]
    csv_path = tmp_path / "imgs" / "data.csv"
    csv_path.write_text("\n".join(lines) + "\n")
    ds = load_dataset("csv", root=csv_path)
    assert len(ds) == 12 and ds.class_names[3] == "bird3"
    split = default_split(ds)
    assert split.train == (0, 1) and split.val == (2,) and split.test == (3,)
    csv_path.write_text("path,label,split\nclass_0/0.jpg,1,train\nclass_0/1.jpg,1,test\n")
    with pytest.raises(DataError, match="class-disjoint"):
        load_dataset("csv", root=csv_path)
    csv_path.write_text("file,class\nclass_0/0.jpg,1\n")
    with pytest.raises(DataError, match="'path' and 'label'"):
        load_dataset("csv", root=csv_path)
    # Excel's "CSV UTF-8" (a byte-order mark) reads; a row without a label is refused (it was a
    # class named "" of unrelated images); "01" and "1" are two classes, not one
    csv_path.write_bytes("\ufeffpath,label\nclass_0/0.jpg,01\nclass_1/0.jpg,1\n".encode())
    assert sorted(load_dataset("csv", root=csv_path).class_names.values()) == ["01", "1"]
    csv_path.write_text("path,label\nclass_0/0.jpg,a\nclass_1/0.jpg,\n")
    with pytest.raises(DataError, match=r"1 row\(s\) have no label \(line\(s\) 3\)"):
        load_dataset("csv", root=csv_path)


@pytest.mark.parametrize("name, expected", [
    ("cub200", "CUB_200_2011.tgz"),
    ("cars196", "car_ims.tgz"),
    ("sop", "Stanford_Online_Products.zip"),
    ("inshop", "list_eval_partition.txt"),
    ("omniglot", "images_background.zip"),
    ("att_faces", "s1..s40"),
    ("binary_alphadigits", "binaryalphadigs.mat"),
])
def test_missing_data_says_where_to_put_it(tmp_path, name, expected):
    with pytest.raises(DataNotFoundError) as info:
        load_dataset(name, root=tmp_path)
    msg = str(info.value)
    assert expected in msg and str(tmp_path) in msg


def test_unknown_dataset_and_bad_options(tmp_path):
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_dataset("imagenet21k", root=tmp_path)
    with pytest.raises(TypeError):
        load_dataset("binary_alphadigits", root=tmp_path, no_such_option=1)
    with pytest.raises(DataNotFoundError):
        load_dataset("image_folder", root=tmp_path / "nope")


# -- splits ---------------------------------------------------------------------------------------


def test_split_classes_ratios_and_order():
    s = split_classes(range(1, 201), (4, 1, 5))
    assert s.sizes == {"train": 80, "val": 20, "test": 100}
    assert s.train == tuple(range(1, 81)) and s.val == tuple(range(81, 101))
    assert split_classes(range(196), (4, 1, 5)).sizes == {"train": 78, "val": 20, "test": 98}
    r1 = split_classes(range(200), (4, 1, 5), order="random", seed=1)
    r2 = split_classes(range(200), (4, 1, 5), order="random", seed=1)
    r3 = split_classes(range(200), (4, 1, 5), order="random", seed=2)
    assert r1 == r2 and r1 != r3 and r1.sizes == s.sizes
    assert set(r1.train) | set(r1.val) | set(r1.test) == set(range(200))
    assert r1.train != tuple(range(80))
    half = split_classes(range(10), (1, 1))
    assert half.train == tuple(range(5)) and half.val == () and half.test == tuple(range(5, 10))
    with pytest.raises(ConfigError):
        split_classes(range(10), (1, 1), order="sorted")


def test_kfold_blocks_are_the_seed_partitions():
    classes = list(range(1, 201))
    dev = split_classes(classes, (1, 1)).train  # first half: 1..100
    blocks = kfold_class_partitions(dev, 4)
    assert [len(b) for b in blocks] == [25, 25, 25, 25]
    assert blocks[0] == list(range(1, 26))  # the first 12.5 % of all classes
    assert blocks[3] == list(range(76, 101))
    train, val = fold_split(dev, 4, 1)
    assert val == list(range(26, 51)) and train == list(range(1, 26)) + list(range(51, 101))
    assert [len(b) for b in kfold_class_partitions(range(10), 4)] == [3, 3, 2, 2]
    with pytest.raises(ConfigError):
        fold_split(dev, 4, 4)
    with pytest.raises(DataError):
        kfold_class_partitions(range(3), 4)


def test_class_split_validation_and_json_round_trip(tmp_path):
    s = ClassSplit(train=[3, 1], val=[5], test=[7, 8], meta={"dataset": "toy"})
    path = s.to_json(tmp_path / "split.json")
    data = json.loads(path.read_text())
    assert data["train"] == [3, 1] and data["format"].startswith("dmlkit.class_split")
    back = ClassSplit.from_json(path)
    assert back == s and back.meta == {"dataset": "toy"}
    with pytest.raises(DataError, match="class-disjoint"):
        ClassSplit(train=[1, 2], test=[2, 3])
    with pytest.raises(DataError, match="at least one test"):
        ClassSplit(train=[1], test=[])
    with pytest.raises(DataNotFoundError):
        ClassSplit.from_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        ClassSplit.from_json(tmp_path / "bad.json")


def test_default_split_val_fraction_and_apply():
    data = np.zeros((20, 2, 2), dtype=np.uint8)
    labels = np.repeat(np.arange(10), 2)
    ds = ArrayDataset(data, labels, class_groups={c: ("train" if c < 6 else "test") for c in range(10)},
                      split_groups={"train": "train", "test": "test"}, name="toy")
    s = default_split(ds, val_fraction=0.34)
    assert s.train == (0, 1, 2, 3) and s.val == (4, 5) and s.test == (6, 7, 8, 9)
    r = default_split(ds, val_fraction=0.34, order="random", seed=3)
    assert len(r.val) == 2 and set(r.train) | set(r.val) == set(range(6))
    parts = s.apply(ds)
    assert parts["val"].classes.tolist() == [4, 5] and len(parts["test"]) == 8
    with pytest.raises(DataError, match="not in dataset"):
        ClassSplit(train=[0], test=[42]).apply(ds)
    with pytest.raises(ConfigError):
        default_split(ds, val_fraction=1.0)


# -- transforms -----------------------------------------------------------------------------------


def test_transform_presets_shapes_and_values():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8))
    train = get_transforms("imagenet", train=True)
    evalt = get_transforms("imagenet", train=False)
    assert train(img).shape == (3, 227, 227) and evalt(img).shape == (3, 227, 227)
    assert "RandomResizedCrop(size=(227, 227), scale=(0.16, 1.0)" in repr(train)
    assert "Resize(size=256" in repr(evalt) and "CenterCrop(size=(227, 227))" in repr(evalt)
    gray = Image.fromarray(np.zeros((112, 92), dtype=np.uint8))
    assert evalt(gray).shape == (3, 227, 227)  # grayscale converted to RGB
    # eval is deterministic, train is random
    assert torch.equal(evalt(img), evalt(img))
    torch.manual_seed(0)
    a = train(img)
    assert not torch.equal(a, train(img))
    g = get_transforms("grayscale", train=True, image_size=28)
    out = g(gray)
    assert out.shape == (1, 28, 28) and float(out.min()) >= -1.0 and float(out.max()) <= 1.0
    assert get_transforms("grayscale", train=False)(gray).shape == (1, 112, 92)
    resize = get_transforms("imagenet_resize", train=False)
    assert resize(gray).shape == (3, 224, 224) and "CenterCrop" not in repr(resize)
    assert get_transforms("imagenet_resize", train=True, image_size=96)(img).shape == (3, 96, 96)
    assert get_transforms("none", train=True) is None
    with pytest.raises(ConfigError):
        get_transforms("fancy", train=True)


def test_dataloader_batches_with_workers(data_root):
    from torch.utils.data import DataLoader

    ds = load_dataset("binary_alphadigits", root=data_root).with_transform(
        get_transforms("grayscale", train=True, image_size=28))
    loader = DataLoader(ds, batch_size=16, num_workers=2, shuffle=False)
    x, y = next(iter(loader))
    assert x.shape == (16, 1, 28, 28) and y.dtype == torch.int64 and y.tolist() == [0] * 16
