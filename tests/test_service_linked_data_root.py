"""`dmlkit serve` over a data root of symlinked class folders (the layout docs/configuration.md
shows: ``ln -s $DMLKIT_DATA/att_faces/s1 faces10/s1``): thumbnails and the start-up model check
follow the links, and ``..`` ids still stay out."""

from __future__ import annotations

import warnings
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
from PIL import Image

from dmlkit.apps import EmbeddingIndex
from dmlkit.exceptions import ConfigError

pytest.importorskip("fastapi")
pytest.importorskip("faiss")
from fastapi.testclient import TestClient

from dmlkit.apps.service import ServiceConfig, create_app

COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}


class MeanColour:
    """A stand-in model: the unit-length mean colour of an image (3-d), as fast as it gets."""

    mode = "RGB"
    reference_size = (8, 8)

    def __call__(self, images: list) -> np.ndarray:
        x = np.stack([np.asarray(im.convert("RGB"), dtype=np.float64).reshape(-1, 3).mean(0) for im in images])
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _linked_root(tmp_path: Path) -> Path:
    """``root/<class>`` symlinks to ``real/<class>``, two images per class."""
    for name, colour in COLOURS.items():
        (tmp_path / "real" / name).mkdir(parents=True)
        for k in range(2):
            Image.new("RGB", (16, 16), tuple(c + 20 * k for c in colour)).save(tmp_path / "real" / name / f"{k}.png")
        (tmp_path / "root").mkdir(exist_ok=True)
        (tmp_path / "root" / name).symlink_to(tmp_path / "real" / name, target_is_directory=True)
    return tmp_path / "root"


def _index(root: Path, model: MeanColour, roll: int = 0) -> EmbeddingIndex:
    ids = [f"{name}/{k}.png" for name in COLOURS for k in range(2)]
    x = model([Image.open(root / i) for i in ids])
    return EmbeddingIndex(np.roll(x, roll, axis=0), ids=ids, info={"data_root": str(root)})


def test_thumbnails_follow_symlinked_class_folders(tmp_path):
    root = _linked_root(tmp_path)
    client = TestClient(create_app(ServiceConfig(index="unused"), index=_index(root, MeanColour()), embedder=MeanColour()))
    r = client.get(f"/api/items/{quote('green/1.png', safe='')}/thumbnail")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text


def test_another_models_index_is_refused_over_symlinked_class_folders(tmp_path):
    # the check resolved each file, found it outside the root and skipped it: the wrong model
    # was accepted without a word
    root = _linked_root(tmp_path)
    with pytest.raises(ConfigError, match="another model"):
        create_app(ServiceConfig(index="unused"), index=_index(root, MeanColour(), roll=2), embedder=MeanColour())


def test_a_model_check_that_compared_nothing_says_so(tmp_path):
    root = _linked_root(tmp_path)
    elsewhere = tmp_path / "empty"
    elsewhere.mkdir()
    with pytest.warns(UserWarning, match="model was not checked against the index: none of its first 6 ids"):
        create_app(ServiceConfig(index="unused", data_root=elsewhere), index=_index(root, MeanColour()),
                   embedder=MeanColour())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a check that compared images is silent
        create_app(ServiceConfig(index="unused"), index=_index(root, MeanColour()), embedder=MeanColour())


@pytest.mark.parametrize("bad_id", ["../real/red/0.png", "red/../../real/red/0.png"])
def test_dot_dot_ids_stay_outside_a_linked_root(tmp_path, bad_id):
    root = _linked_root(tmp_path)
    x = np.eye(3, dtype=np.float32)[[0, 1]]
    idx = EmbeddingIndex(x, ids=[bad_id, "red/0.png"], info={"data_root": str(root)})
    client = TestClient(create_app(ServiceConfig(index="unused"), index=idx))
    r = client.get(f"/api/items/{quote(bad_id, safe='')}/thumbnail")
    assert r.status_code == 404 and "outside the data root" in r.json()["detail"]
