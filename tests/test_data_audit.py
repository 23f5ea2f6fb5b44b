"""Audit of dmlkit.data, the samplers, distances and embedding files: each test pins a bug that
gave a silent wrong result (or a traceback) with tiny real-format fixtures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmlkit.data import ArrayDataset, ImageFileDataset, load_dataset, split_classes
from dmlkit.data.pairs import parse_lfw_pairs, read_pair_csv
from dmlkit.embedding_files import read_labels_file
from dmlkit.embedding_shards import write_shards
from dmlkit.exceptions import ConfigError, DataError, ShapeError

BOM = "\ufeff"


def _png(path: Path, img: Image.Image) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


# -- labels files: a UTF-8 byte-order mark (Notepad, Excel) -----------------------------------------
@pytest.mark.parametrize("suffix", [".txt", ".csv"])
def test_labels_file_with_a_byte_order_mark_keeps_the_first_label(tmp_path, suffix):
    numbers = tmp_path / f"numbers{suffix}"
    numbers.write_bytes(f"{BOM}3\n3\n4\n".encode())
    assert read_labels_file(numbers).tolist() == [3, 3, 4]  # was ['\ufeff3', '3', '4']: 3 classes
    names = tmp_path / f"names{suffix}"
    names.write_bytes(f"{BOM}cat\ncat\ndog\n".encode())
    assert read_labels_file(names).tolist() == ["cat", "cat", "dog"]


@pytest.mark.parametrize("suffix", [".txt", ".csv"])
def test_labels_file_names_that_python_would_read_as_numbers_stay_names(tmp_path, suffix):
    """Python's int() reads "1_2" as 12 and full-width digits as numbers: the classes "12" and
    "1_2" were one class (5 classes for 6, P@1 0.667 for 0.633)."""
    path = tmp_path / f"labels{suffix}"
    path.write_text("12\n1_2\n3\n\uff11\uff12\n", encoding="utf-8")
    assert read_labels_file(path).tolist() == ["12", "1_2", "3", "\uff11\uff12"]
    path.write_text("12\n-3\n+4\n5.0\n", encoding="utf-8")
    assert read_labels_file(path).tolist() == [12, -3, 4, 5]


# -- pair lists with a byte-order mark --------------------------------------------------------------
def test_pair_csv_with_a_byte_order_mark_reads_its_header(tmp_path):
    for name in ("a.png", "b.png"):
        _png(tmp_path / name, Image.new("L", (4, 4)))
    (tmp_path / "pairs.csv").write_bytes(f"{BOM}path1,path2,same,fold\na.png,b.png,0,1\n".encode())
    pairs = read_pair_csv(tmp_path / "pairs.csv")
    assert len(pairs) == 1 and pairs.same.tolist() == [False] and pairs.num_folds == 1


def test_lfw_pair_list_with_a_byte_order_mark(tmp_path):
    (tmp_path / "pairs.txt").write_bytes(f"{BOM}1 1\nAl 1 2\nAl 1 Bo 1\n".encode())
    pairs = parse_lfw_pairs(tmp_path / "pairs.txt")
    assert [p.same for p in pairs] == [True, False]


# -- SOP: a class listed in both Ebay_train.txt and Ebay_test.txt --------------------------------------
def test_sop_class_in_both_lists_is_refused(tmp_path):
    folder = tmp_path / "Stanford_Online_Products"
    header = "image_id class_id super_class_id path\n"
    train = [(1, 1, 1, "bicycle_final/1_0.JPG"), (2, 2, 1, "bicycle_final/2_0.JPG")]
    test = [(3, 2, 1, "bicycle_final/2_1.JPG"), (4, 3, 1, "bicycle_final/3_0.JPG")]
    for rows, name in ((train, "Ebay_train.txt"), (test, "Ebay_test.txt")):
        for r in rows:
            _png(folder / r[3], Image.new("RGB", (4, 4)))
        (folder / name).write_text(header + "".join(" ".join(map(str, r)) + "\n" for r in rows))
    # was: class 2 silently became a test class holding its training image too
    with pytest.raises(DataError, match="class 2 .*both Ebay_train.txt and Ebay_test.txt"):
        load_dataset("sop", root=tmp_path)


# -- image files kept in their own mode (mode=None) -----------------------------------------------------
def test_default_tensor_of_palette_and_bilevel_images_kept_in_their_mode(tmp_path):
    bits = np.zeros((5, 6), bool)
    bits[2] = True
    red = np.zeros((5, 6, 3), np.uint8)
    red[..., 0] = 200
    palette = Image.fromarray(np.ones((5, 6), np.uint8), mode="P")
    palette.putpalette([0, 0, 0, 200, 0, 0])  # index 1 = (200, 0, 0)
    paths = [_png(tmp_path / "bits.png", Image.fromarray(bits)),
             _png(tmp_path / "palette.png", palette),
             _png(tmp_path / "cmyk.tif", Image.fromarray(red).convert("CMYK"))]
    assert [Image.open(p).mode for p in paths] == ["1", "P", "CMYK"]
    ds = ImageFileDataset(paths, [0, 1, 2], mode=None)
    x = ds[0][0]
    assert x.shape == (1, 5, 6) and x.max().item() == 1.0  # was 1/255: the ink nearly black
    y = ds[1][0]
    assert y.shape == (3, 5, 6)  # was (1, 5, 6): the palette indices / 255
    assert np.allclose(y[:, 0, 0].numpy(), [200 / 255, 0, 0])
    z = ds[2][0]
    assert z.shape == (3, 5, 6) and np.allclose(z[:, 0, 0].numpy(), [200 / 255, 0, 0])


# -- ArrayDataset: integer images other than uint8/uint16 -------------------------------------------------
def test_array_dataset_refuses_wide_integer_images():
    data = np.full((2, 4, 4), 200, dtype=np.int64)  # 0..255 values in an int64 array
    with pytest.raises(DataError, match="uint8"):  # was: tensor values 200, PIL images white
        ArrayDataset(data, [0, 1])
    ok = ArrayDataset(data.astype(np.uint8), [0, 1])
    assert ok[0][0].max().item() == pytest.approx(200 / 255)


# -- embedding shards ---------------------------------------------------------------------------------
def test_shards_iterate_like_an_array(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    s = write_shards(tmp_path / "s", x, np.arange(6) % 2, shard_rows=4)
    rows = list(s)  # was ShapeError after the last row
    assert len(rows) == 6 and np.array_equal(np.stack(rows), x)
    assert np.array_equal(np.asarray(s), x)
    with pytest.raises(IndexError):
        s[6]
    with pytest.raises(IndexError):
        s[-7]
    with pytest.raises(ShapeError):  # out-of-range index arrays stay refused as before
        s[np.array([6])]
    with pytest.raises(IndexError, match="mask"):  # was: the first 2 rows' mask silently used
        s[np.array([True, False])]
    assert np.array_equal(s[np.arange(6) % 2 == 1], x[1::2])


def test_write_shards_refuses_labels_or_ids_of_another_length(tmp_path):
    x = np.zeros((6, 2), np.float32)
    with pytest.raises(ShapeError, match="7 labels"):  # was: the 7th label silently dropped
        write_shards(tmp_path / "a", x, np.arange(7))
    with pytest.raises(ShapeError, match="100 ids"):
        write_shards(tmp_path / "b", x, np.arange(6), ids=np.arange(100))


def test_float32_shards_refuse_values_beyond_float32(tmp_path):
    from dmlkit.exceptions import NonFiniteError

    with pytest.raises(NonFiniteError, match="float32"):  # was: stored as inf
        write_shards(tmp_path / "a", np.full((2, 2), 1e39), np.arange(2))


# -- ratio splits --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [(float("nan"), 1, 1), (float("inf"), 1, 1)])
def test_split_ratios_must_be_finite(bad):
    with pytest.raises(ConfigError, match="ratios"):  # was: 'needs at least one train class'
        split_classes(range(10), bad)


# -- CUB / SOP / In-Shop list files that do not parse ------------------------------------------------
def _cub_lists(root: Path, labels: str) -> None:
    folder = root / "CUB_200_2011"
    for name in ("a.jpg", "b.jpg"):
        _png(folder / "images" / "001.A" / name, Image.new("RGB", (4, 4)))
    (folder / "images.txt").write_text("1 001.A/a.jpg\n2 001.A/b.jpg\n")
    (folder / "image_class_labels.txt").write_text(labels)
    (folder / "classes.txt").write_text("1 001.A\n")


def test_cub_truncated_class_list_is_one_error(tmp_path):
    _cub_lists(tmp_path, "1 1\n")  # image 2 has no class: was KeyError '2'
    with pytest.raises(DataError, match="1 image.* no class .*image id 2"):
        load_dataset("cub200", root=tmp_path)
    _cub_lists(tmp_path, "1 1\n2 x\n")
    with pytest.raises(DataError, match="non-integer"):
        load_dataset("cub200", root=tmp_path)


def test_inshop_bad_item_or_status_is_one_error(tmp_path):
    folder = tmp_path / "InShop"
    _png(folder / "img" / "a.jpg", Image.new("RGB", (4, 4)))
    for line, match in (("img/a.jpg item_7 train", "item id"),  # was: ValueError traceback
                        ("img/a.jpg id_00000007 Train", "evaluation_status")):  # was: a test image
        (folder / "list_eval_partition.txt").write_text(
            f"1\nimage_name item_id evaluation_status\n{line}\n")
        with pytest.raises(DataError, match=match):
            load_dataset("inshop", root=tmp_path)


def test_sop_non_integer_class_is_one_error(tmp_path):
    folder = tmp_path / "Stanford_Online_Products"
    _png(folder / "bicycle_final" / "1_0.JPG", Image.new("RGB", (4, 4)))
    header = "image_id class_id super_class_id path\n"
    (folder / "Ebay_train.txt").write_text(header + "1 x1 1 bicycle_final/1_0.JPG\n")
    (folder / "Ebay_test.txt").write_text(header)
    with pytest.raises(DataError, match="class_id 'x1'"):  # was: ValueError traceback
        load_dataset("sop", root=tmp_path)


# -- split files ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("train", ["123", [1.5, 2], [True, 2]])
def test_split_file_lists_must_be_integer_ids(train):
    from dmlkit.data import ClassSplit

    # was: "123" -> classes (1, 2, 3), 1.5 -> class 1, true -> class 1
    with pytest.raises(DataError, match="integer class ids"):
        ClassSplit.from_dict({"train": train, "test": [4]})
    assert ClassSplit.from_dict({"train": [1, 2.0, "3"], "test": [4]}).train == (1, 2, 3)


def test_shards_take_row_and_column_keys(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    s = write_shards(tmp_path / "s", x, np.arange(6) % 2, shard_rows=4)
    # was: TypeError (a tuple key went to np.asarray(...).astype(np.int64))
    assert np.array_equal(s[:, 1], x[:, 1]) and s[3, 0] == x[3, 0]
    assert np.array_equal(s[[5, 0], :1], x[[5, 0], :1]) and np.array_equal(s[...], x)


def test_inverted_uint16_array_images_stay_in_range():
    data = np.array([[[0, 65535, 257]]], dtype=np.uint16)
    ds = ArrayDataset(data, [0], invert=True)
    x = ds[0][0]  # was [1, -65534, -256]
    assert np.allclose(x.numpy(), [[[1.0, 0.0, 65278 / 65535]]])
    assert np.asarray(ds.thumbnail(0, None)).tolist() == [[255, 0, 254]]
    eight = ArrayDataset(np.array([[[0, 255, 1]]], np.uint8), [0], invert=True)[0][0]
    assert np.allclose(eight.numpy(), [[[1.0, 0.0, 254 / 255]]])


# -- samplers ------------------------------------------------------------------------------------------
def test_sampler_negative_seed_or_epoch_is_a_config_error():
    from dmlkit.samplers import EpisodeSampler, MPerClassSampler

    labels = np.repeat(np.arange(4), 4)
    with pytest.raises(ConfigError, match="seed"):  # was: numpy's ValueError at the first batch
        MPerClassSampler(labels, 2, 2, seed=-1)
    with pytest.raises(ConfigError, match="seed"):
        EpisodeSampler(labels, 2, 1, 1, episodes=2, seed=-3)
    sampler = MPerClassSampler(labels, 2, 2, seed=0)
    with pytest.raises(ConfigError, match="epoch"):
        sampler.set_epoch(-1)


@pytest.mark.parametrize("labels", [[None, None, 1, 1], np.array([1, 1, "a", "a"], dtype=object),
                                    [0.5, 0.5, 1.5, 1.5]])
def test_sampler_labels_that_are_no_class_ids_are_one_error(labels):
    """None or mixed labels gave numpy's TypeError from np.unique; fractions were classes."""
    from dmlkit.samplers import EpisodeSampler, MPerClassSampler

    with pytest.raises(ShapeError, match="sampler labels"):
        MPerClassSampler(labels, 2, 2)
    with pytest.raises(ShapeError, match="sampler labels"):
        EpisodeSampler(labels, 2, 1, 1, episodes=2)


def test_subset_refuses_fractional_indices():
    ds = ArrayDataset(np.arange(10, dtype=np.float32).reshape(5, 2), [0, 1, 2, 3, 4], kind="features")
    with pytest.raises(IndexError, match="integers"):  # was: row 1, silently
        ds.subset(np.array([1.7]))
    assert ds.subset([]).labels.tolist() == [] and ds.subset([4, -5]).labels.tolist() == [4, 0]


def test_shards_refuse_fractional_row_indices(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    s = write_shards(tmp_path / "s", x, np.arange(6) % 2)
    with pytest.raises(IndexError, match="integers"):  # was: row 1, silently
        s[np.array([1.7])]
    assert s[[]].shape == (0, 2)


def test_default_split_refuses_classes_in_no_split_group():
    """Was: a class with no group (or a group the split does not read) was silently in neither
    train nor test: never trained on, never evaluated."""
    from dmlkit.data import default_split

    data = np.zeros((8, 4, 4), np.uint8)
    labels = [0, 0, 1, 1, 2, 2, 3, 3]
    groups = {"train": "train", "test": "test"}
    ok = ArrayDataset(data, labels, class_groups={0: "train", 1: "train", 2: "test", 3: "test"},
                      split_groups=groups)
    assert (list(default_split(ok).train), list(default_split(ok).test)) == ([0, 1], [2, 3])
    for class_groups in ({0: "train", 1: "train", 2: "test"}, {0: "train", 1: "dev", 2: "test", 3: "test"}):
        ds = ArrayDataset(data, labels, class_groups=class_groups, split_groups=groups)
        with pytest.raises(DataError, match="in no split group"):
            default_split(ds)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("p", [1.0, 3.0])
def test_lp_distance_of_half_precision_rows_on_the_cpu(dtype, p):
    """Was: LpDistance(p != 2) of float16 / bfloat16 rows raised torch's NotImplementedError
    ("cdist" not implemented for 'Half'); now the float32 distances in the rows' dtype."""
    import torch

    from dmlkit.distances import LpDistance

    x = torch.tensor([[0.0, 1.0], [2.0, -1.0], [0.5, 0.5]], dtype=getattr(torch, dtype))
    d = LpDistance(p=p, normalize_embeddings=False)(x, x)
    want = torch.cdist(x.float(), x.float(), p=p).to(x.dtype)
    assert d.dtype == x.dtype and torch.equal(d, want)
