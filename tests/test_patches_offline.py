"""The offline builder of real patch correspondences (scikit-image's photographs, Brown layout)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from dmlkit.apps.patches import OFFLINE_SUBSETS, OfflineSpec, brown, load_subset
from dmlkit.apps.patches.offline import build_offline_dataset, build_offline_subset
from dmlkit.exceptions import ConfigError, DataError

SPEC = OfflineSpec(points_per_subset=60, views=3, train_pairs=300, test_pairs=120, seed=3)


def _ncc(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.reshape(len(a), -1).astype(np.float64)
    b = b.reshape(len(b), -1).astype(np.float64)
    a = a - a.mean(1, keepdims=True)
    b = b - b.mean(1, keepdims=True)
    return (a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1) + 1e-9)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("offline")
    build_offline_subset(root / "stereo", "stereo", SPEC, sources=("stereo_motorcycle",))
    build_offline_subset(root / "photos", "photos", SPEC, sources=("camera",))
    return root


def test_subsets_are_disjoint() -> None:
    names = [s for srcs in OFFLINE_SUBSETS.values() for s in srcs]
    assert len(names) == len(set(names)) and len(OFFLINE_SUBSETS) == 3


def test_brown_layout_and_balanced_pairs(built: Path) -> None:
    for name in ("stereo", "photos"):
        sub = load_subset(built, name)
        assert len(sub) == 60 * 3 and sub.patches.shape[1:] == (64, 64)
        assert np.array_equal(sub.point_ids, np.repeat(np.arange(60), 3))
        assert sorted(sub.matches) == [120, 300]
        for n in (300, 120):
            pairs = sub.pairs(n)
            assert len(pairs) == n and pairs.label.sum() == n // 2
            assert np.array_equal(pairs.label, (sub.point_ids[pairs.left] == sub.point_ids[pairs.right]).astype(int))
            assert np.all(pairs.left != pairs.right)


def test_positives_are_true_correspondences(built: Path) -> None:
    """Two views of one point look alike far more than a point and its nearby hard negative."""
    for name in ("stereo", "photos"):
        sub = load_subset(built, name)
        pairs = sub.pairs(300)
        pos, neg = pairs.label == 1, pairs.label == 0
        ncc = _ncc(sub.patches[pairs.left], sub.patches[pairs.right])
        assert np.median(ncc[pos]) > 0.5
        assert np.median(ncc[pos]) > np.median(ncc[neg]) + 0.3
    # the real stereo views (left / right camera, views 0 and 1) agree pixel for pixel up to noise
    sub = load_subset(built, "stereo")
    assert np.median(_ncc(sub.patches[0::3], sub.patches[1::3])) > 0.7


def test_reproducible(built: Path, tmp_path: Path) -> None:
    build_offline_subset(tmp_path / "photos", "photos", SPEC, sources=("camera",))
    for f in sorted((built / "photos").iterdir()):
        assert hashlib.sha256(f.read_bytes()).digest() == hashlib.sha256((tmp_path / "photos" / f.name).read_bytes()).digest()


def test_bad_spec() -> None:
    with pytest.raises(ConfigError):
        OfflineSpec(views=1)
    with pytest.raises(ConfigError):
        OfflineSpec(hard_fraction=2.0)
    with pytest.raises(ConfigError, match="unknown offline subset"):
        build_offline_subset("/nonexistent", "liberty")
    with pytest.raises(ConfigError, match="skimage.data"):
        build_offline_subset("/nonexistent", "photos", SPEC, sources=("no_such_image",))


def test_an_interrupted_build_leaves_no_half_built_subset_in_use(tmp_path: Path, monkeypatch) -> None:
    """`patches build-data` killed between a subset's two match files left the subset half-built
    in place (its old test file deleted, the new one not written), and `patches train` used it
    without a word: the test list fell back to the smallest m50 file there, the 300-pair
    training file. The subset is now built beside its folder and moved in once complete, and
    the manifest (which lists a subset only while its files are complete) gates the readers."""
    root = tmp_path / "o"
    small = OfflineSpec(points_per_subset=20, views=2, train_pairs=40, test_pairs=20, seed=1)
    build_offline_dataset(root, small, ("photos",))
    before = {p.name: p.read_bytes() for p in (root / "photos").iterdir()}
    real_write = brown.atomic_write_text

    def killed_before_the_test_pairs(path, text):
        if Path(path).name == "m50_20_20_0.txt":
            raise KeyboardInterrupt  # the kill, between the two match files
        return real_write(path, text)

    monkeypatch.setattr(brown, "atomic_write_text", killed_before_the_test_pairs)
    with pytest.raises(KeyboardInterrupt):
        build_offline_dataset(root, OfflineSpec(points_per_subset=20, views=2, train_pairs=40, test_pairs=20,
                                                seed=2), ("photos",))
    assert {p.name: p.read_bytes() for p in (root / "photos").iterdir()} == before  # the old subset, whole
    assert sorted(p.name for p in root.iterdir()) == ["build.lock", "manifest.json", "photos"]  # nothing half-built
    # a build that did not finish is not in the manifest: its subset is refused, not read
    with pytest.raises(DataError, match=r"photos.* is not listed in .*manifest\.json.*did not finish"):
        load_subset(root, "photos")
    monkeypatch.setattr(brown, "atomic_write_text", real_write)
    build_offline_dataset(root, small, ("photos",))  # built again: read as before
    assert sorted(load_subset(root, "photos").matches) == [20, 40]
