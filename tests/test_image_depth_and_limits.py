"""Image decoding fidelity (audit s40_images): multi-channel 16-bit files at full depth, the
"would be blank" check on them, float arrays rounded, decompression bombs and the pixel limit
at ``dmlkit serve``'s start, upload errors naming the file, and the unreadable-image hint of
commands that cannot skip.

Every expectation is a numpy oracle: ``rint(v * 255 / 65535)`` of the 16-bit samples written
into the file (the scale of ``to_8bit`` for gray 16-bit images, OpenCV's and torchvision's).
The files are written here, by hand for PNG (Pillow cannot write 16-bit colour PNGs)."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmlkit.data import ArrayDataset, get_transforms, load_image
from dmlkit.exceptions import DataError

H, W = 12, 20
#: PNG colour types: 2 RGB, 4 gray + alpha, 6 RGBA.
_COLOUR_TYPE = {3: 2, 2: 4, 4: 6}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png16(path: Path, arr: np.ndarray, orientation: int | None = None) -> Path:
    """A 16-bit PNG of ``arr`` (H, W, C) uint16, C in 2/3/4, rows filtered with None, Sub and Up
    in turn (Sub and Up work on whole pixels of 2 C bytes: a decoder must unfilter them as
    such), with an eXIf orientation when given."""
    h, w, c = arr.shape
    rows = arr.astype(">u2").reshape(h, -1).view(np.uint8).reshape(h, w * c * 2).astype(np.int16)
    bpp = 2 * c
    out = b""
    for r in range(h):
        kind = r % 3
        if kind == 0:
            line = rows[r]
        elif kind == 1:  # Sub: minus the byte one pixel to the left
            line = rows[r] - np.concatenate([np.zeros(bpp, np.int16), rows[r][:-bpp]])
        else:  # Up: minus the byte above
            line = rows[r] - rows[r - 1]
        out += bytes([kind]) + (line % 256).astype(np.uint8).tobytes()
    data = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, _COLOUR_TYPE[c], 0, 0, 0))
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        raw = exif.tobytes()
        data += _chunk(b"eXIf", raw[6:] if raw.startswith(b"Exif\x00\x00") else raw)
    path.write_bytes(data + _chunk(b"IDAT", zlib.compress(out)) + _chunk(b"IEND", b""))
    return path


def oracle(arr: np.ndarray) -> np.ndarray:
    """The 8-bit pixels of 16-bit samples: ``rint(v * 255 / 65535)``."""
    return np.rint(arr.astype(np.float64) * 255.0 / 65535.0).astype(np.uint8)


@pytest.fixture
def samples() -> np.ndarray:
    """Random 16-bit samples (H, W, 4), seeded: a quarter differ between ``v >> 8`` and the oracle."""
    return np.random.default_rng(0).integers(0, 65536, size=(H, W, 4), dtype=np.uint16)


# -- finding 2: 16-bit colour at full depth ---------------------------------------------------
def test_16bit_rgb_png_is_decoded_at_full_depth(tmp_path, samples):
    rgb = samples[..., :3]
    got = np.asarray(load_image(write_png16(tmp_path / "rgb16.png", rgb), "RGB"))
    assert (got == oracle(rgb)).all()
    assert (oracle(rgb) != (rgb >> 8)).mean() > 0.2  # Pillow's v >> 8: a quarter of them one level off


def test_16bit_rgba_png_is_decoded_at_full_depth(tmp_path, samples):
    got = load_image(write_png16(tmp_path / "rgba16.png", samples), None)
    assert got.mode == "RGBA" and (np.asarray(got) == oracle(samples)).all()


def test_16bit_gray_alpha_png_is_two_channels_at_full_depth(tmp_path, samples):
    la = samples[..., :2]
    path = write_png16(tmp_path / "la16.png", la)
    kept = load_image(path, None)  # Pillow gave RGBA: 4 channels where an 8-bit LA file gives 2
    assert kept.mode == "LA" and (np.asarray(kept) == oracle(la)).all()
    rgb = np.asarray(load_image(path, "RGB"))  # alpha dropped, gray replicated
    assert (rgb == oracle(la[..., :1])).all()


def test_16bit_png_eXIf_orientation_is_applied(tmp_path, samples):
    rgb = samples[..., :3]
    got = np.asarray(load_image(write_png16(tmp_path / "o6.png", rgb, orientation=6), "RGB"))
    assert got.shape == (W, H, 3) and (got == np.rot90(oracle(rgb), -1)).all()  # 6: turned 90° clockwise


@pytest.mark.parametrize("compression", [None, "zlib"])  # Pillow's raw decoder; libtiff's
def test_16bit_rgb_tiff_is_decoded_at_full_depth(tmp_path, samples, compression):
    tifffile = pytest.importorskip("tifffile")
    rgb = samples[..., :3]
    path = tmp_path / "rgb16.tiff"
    tifffile.imwrite(path, rgb, photometric="rgb", compression=compression, extratags=[(274, 3, 1, 6, True)])
    got = np.asarray(load_image(path, "RGB"))
    assert (got == np.rot90(oracle(rgb), -1)).all()  # the TIFF's orientation applied once


@pytest.mark.parametrize("channels", [2, 3, 4])
def test_16bit_colour_that_would_be_blank_is_refused(tmp_path, channels):
    """Values 0..700 of 0..65535 were refused as a gray 16-bit file and accepted as a 3-level,
    near-black colour image; opaque alpha (65535) must not count as a level."""
    low = (np.arange(H * W).reshape(H, W) * 700 // (H * W - 1)).astype(np.uint16)
    arr = np.stack([low] * channels, axis=-1)
    if channels in (2, 4):
        arr[..., -1] = 65535
    path = write_png16(tmp_path / f"low{channels}.png", arr)
    with pytest.raises(DataError, match=r"uses only values 0\.\.700 of 0\.\.65535: scaled to 8 bits it would be blank"):
        load_image(path, "RGB")


def test_8bit_data_in_a_16bit_rgb_file_is_refused_not_solid_black(tmp_path):
    b = (np.arange(H * W).reshape(H, W) % 256).astype(np.uint16)
    path = write_png16(tmp_path / "u8in16.png", np.stack([b, b[:, ::-1], b], axis=-1))
    with pytest.raises(DataError, match="would be blank"):
        load_image(path, "RGB")


def test_constant_16bit_colour_is_not_refused(tmp_path):
    arr = np.full((H, W, 3), 0x8000, np.uint16)  # one colour: nothing to lose
    assert (np.asarray(load_image(write_png16(tmp_path / "flat.png", arr), "RGB")) == 128).all()


def test_skip_corrupt_skips_a_blank_16bit_colour_file(tmp_path, samples):
    from dmlkit.data import ImageFileDataset

    good = write_png16(tmp_path / "good.png", samples[..., :3])
    low = write_png16(tmp_path / "low.png", (samples[..., :3] >> 10).astype(np.uint16))  # 0..63
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        ds = ImageFileDataset([good, low], [0, 1], skip_corrupt=True)
    assert ds.skipped == [str(low)] and "would be blank" in ds.skip_reasons[str(low)]


# -- finding 5: float arrays rounded, as float image files are ---------------------------------
def test_float_array_images_are_rounded_not_truncated():
    r = np.random.default_rng(0).random((1, 32, 32)).astype(np.float32)
    ds = ArrayDataset(r, [0]).with_transform(get_transforms("grayscale", train=False, normalize=False))
    got = np.rint(ds[0][0].numpy()[0] * 255).astype(int)
    want = np.rint(r[0].astype(np.float64) * 255).astype(int)
    assert (got == want).all()  # truncation put about half of them one level low


# -- finding 4: serve's start-up check -------------------------------------------------------
def _needs_serve() -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("faiss")


class _MeanColour:
    """A stand-in model: the unit-length mean colour (3-d)."""

    mode = "RGB"
    reference_size = (8, 8)

    def __call__(self, images: list) -> np.ndarray:
        x = np.stack([np.asarray(im.convert("RGB"), dtype=np.float64).reshape(-1, 3).mean(0) + 1 for im in images])
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _service(tmp_path: Path, ids: list[str], vectors: np.ndarray, **config):
    _needs_serve()
    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.service import ServiceConfig, create_app

    idx = EmbeddingIndex(vectors.astype(np.float32), ids=ids, info={"data_root": str(tmp_path)})
    return create_app(ServiceConfig(index="unused", **config), index=idx, embedder=_MeanColour())


def test_serve_starts_when_an_indexed_file_is_a_decompression_bomb(tmp_path, monkeypatch):
    """An indexed file beyond PIL's limit raised DecompressionBombError out of create_app: a
    traceback at `dmlkit serve`'s start."""
    Image.new("RGB", (40, 40), (200, 30, 30)).save(tmp_path / "bomb.png")  # 1600 px > 2 x 500
    Image.new("RGB", (8, 8), (30, 200, 30)).save(tmp_path / "ok.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    model = _MeanColour()
    vectors = np.concatenate([model([Image.new("RGB", (8, 8), (1, 2, 3))]),
                              model([Image.open(tmp_path / "ok.png")])])
    _service(tmp_path, ["bomb.png", "ok.png"], vectors)  # checked on ok.png: it starts


def test_serve_start_check_does_not_decode_files_over_max_image_pixels(tmp_path):
    """The upload limit applies to the indexed files the start-up check decodes: one larger is
    passed over (its vector here is another model's: decoded, it would be refused)."""
    Image.new("RGB", (30, 30), (200, 30, 30)).save(tmp_path / "big.png")
    wrong = _MeanColour()([Image.new("RGB", (8, 8), (30, 30, 200))])
    with pytest.warns(UserWarning, match=r"1 larger than 800 pixels"):
        _service(tmp_path, ["big.png"], wrong, max_image_pixels=800)
    from dmlkit.exceptions import ConfigError

    with pytest.raises(ConfigError, match="another model"):  # within the limit it is compared
        _service(tmp_path, ["big.png"], wrong, max_image_pixels=900)


def test_thumbnails_of_files_over_max_image_pixels_are_refused(tmp_path):
    _needs_serve()
    from fastapi.testclient import TestClient

    Image.new("RGB", (30, 30), (200, 30, 30)).save(tmp_path / "big.png")
    vec = _MeanColour()([Image.open(tmp_path / "big.png")])
    with pytest.warns(UserWarning, match="not checked against the index"):  # too large to check
        client = TestClient(_service(tmp_path, ["big.png"], vec, max_image_pixels=800))
    r = client.get("/api/items/big.png/thumbnail")
    assert r.status_code == 404 and "30x30 pixels, more than the limit of 800" in r.json()["detail"]


# -- findings 2 and 7 through serve: uploads ---------------------------------------------------
@pytest.fixture
def upload_client():
    """A service whose model hands back its preprocessed input (``transform=None``: pixels / 255)."""
    _needs_serve()
    from fastapi.testclient import TestClient

    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.export import ImageEmbedder
    from dmlkit.apps.service import ServiceConfig, create_app

    seen: dict[str, np.ndarray] = {}

    def forward(x: np.ndarray) -> np.ndarray:
        seen["x"] = x.copy()
        return x.reshape(len(x), -1)[:, :8]

    embedder = ImageEmbedder(forward=forward, transform=None, image_size=None, in_channels=3, runtime="torch")
    idx = EmbeddingIndex(np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32))
    client = TestClient(create_app(ServiceConfig(index="unused", threshold=0.5), index=idx, embedder=embedder),
                        raise_server_exceptions=False)
    return client, seen


def test_a_16bit_rgb_upload_is_embedded_at_full_depth(tmp_path, samples, upload_client):
    client, seen = upload_client
    rgb = samples[..., :3]
    data = write_png16(tmp_path / "rgb16.png", rgb).read_bytes()
    r = client.post("/api/query/image", files={"file": ("rgb16.png", data, "image/png")}, data={"k": "1"})
    assert r.status_code == 200, r.text
    got = np.rint(seen["x"][0].transpose(1, 2, 0) * 255).astype(np.uint8)
    assert (got == oracle(rgb)).all()


def test_a_blank_16bit_rgb_upload_is_refused_naming_the_file(tmp_path, upload_client):
    client, _ = upload_client
    low = np.stack([(np.arange(H * W).reshape(H, W) * 700 // (H * W - 1)).astype(np.uint16)] * 3, axis=-1)
    data = write_png16(tmp_path / "low.png", low).read_bytes()
    r = client.post("/api/query/image", files={"file": ("scan_0042.png", data, "image/png")})
    assert r.status_code == 422 and "image scan_0042.png (16-bit RGB)" in r.json()["detail"]


def test_upload_errors_name_the_uploaded_file(upload_client):
    """They said "image #0": on /api/verify, #0 and #1 did not say which upload was bad."""
    client, _ = upload_client
    ok, bad = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(ok, format="PNG")
    Image.fromarray(np.full((16, 16), 3.0, np.float32), "F").save(bad, format="TIFF")
    r = client.post("/api/verify", files={"image1": ("cat.png", ok.getvalue(), "image/png"),
                                          "image2": ("float255.tiff", bad.getvalue(), "image/tiff")})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("image float255.tiff is a float image (mode F) with values outside [0, 1]")


# -- finding 6: the unreadable-image hint of commands that cannot skip ---------------------------
@pytest.mark.parametrize(("command", "hint"), [
    ("embed", "Replace or delete the file"),
    ("verify", "Replace or delete the file"),
    ("train", "Replace or delete the file, or pass --set data.options.skip_corrupt=true to skip unreadable images"),
])
def test_the_unreadable_image_hint_is_one_the_command_can_follow(tmp_path, monkeypatch, capsys, command, hint):
    """`embed` refuses a run's config.yaml edited to skip ("not a checkpoint of the run"), and
    `verify --pair-list` reads no config: their hint said to set data.options.skip_corrupt."""
    import typer

    from dmlkit import cli

    good = io.BytesIO()
    Image.new("RGB", (16, 16)).save(good, format="JPEG")
    trunc = tmp_path / "trunc.jpg"
    trunc.write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    probe = typer.Typer()

    @probe.command(command)
    def _run() -> None:
        load_image(trunc)

    @probe.command("other")
    def _other() -> None:
        pass

    monkeypatch.setattr(cli, "app", probe)
    with pytest.raises(SystemExit) as stop:
        cli.main([command])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith(f"error: cannot read image {trunc}: ") and err.rstrip().endswith(hint), err
    assert (command == "train") == ("skip_corrupt" in err)
