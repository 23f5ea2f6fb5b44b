"""Weights never execute pickles (issue 11, point 14).

A malicious weights file, whose unpickling would create a marker file, must be refused by every
path that loads weights (a local ``weights=`` file, the torch hub cache of BN-Inception and of
torchvision trunks, a fresh download), with a one-line error that does not advise
``weights_only=False``; downloads are checked against their published SHA-256 first.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch

from dmlkit.exceptions import CheckpointError, ConfigError
from dmlkit.models import build_trunk, load_weights_file
from dmlkit.models.bn_inception import BN_INCEPTION_SHA256, BN_INCEPTION_URL
from dmlkit.models.trunks import fetch_weights, published_sha256_prefix


class _Payload:
    """Unpickling this object calls ``open(marker, "w")``: the marker proves code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious(path: Path, marker: Path) -> Path:
    torch.save({"conv1.weight": torch.zeros(1), "payload": _Payload(marker)}, path)
    return path


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A private torch hub dir; any network access fails the test."""
    before = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "hub"))

    def no_network(*args, **kwargs):
        raise AssertionError("the network must not be used")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    yield tmp_path / "hub" / "checkpoints"
    torch.hub.set_dir(before)


def _one_line_refusal(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg, msg
    assert "weights_only=False" not in msg and "weights_only" not in msg.replace("weights_only=True", ""), msg
    return msg


def test_the_fixture_really_runs_code(tmp_path):
    """Sanity check of the payload: an unsafe load creates the marker (harmless: a temp file)."""
    marker = tmp_path / "ran"
    bad = _malicious(tmp_path / "bad.pth", marker)
    torch.load(bad, weights_only=False)
    assert marker.exists()


def test_local_weights_file_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    bad = _malicious(tmp_path / "bad.pth", marker)
    with pytest.raises(CheckpointError) as info:
        load_weights_file(bad)
    msg = _one_line_refusal(info.value)
    assert "never unpickles" in msg and str(bad) in msg
    with pytest.raises(CheckpointError):
        build_trunk("bn_inception", weights=bad)
    with pytest.raises(CheckpointError):
        build_trunk("resnet18", weights=bad)
    assert not marker.exists()


def test_truncated_weights_file_is_one_line(tmp_path):
    good = io.BytesIO()
    torch.save({"w": torch.ones(3)}, good)
    (tmp_path / "cut.pth").write_bytes(good.getvalue()[:50])
    with pytest.raises(CheckpointError, match="cannot load weights file") as info:
        load_weights_file(tmp_path / "cut.pth")
    _one_line_refusal(info.value)


def test_bn_inception_cache_file_is_hash_checked_before_loading(tmp_path, hub):
    marker = tmp_path / "ran"
    hub.mkdir(parents=True)
    _malicious(hub / "bn_inception-52deb4733.pth", marker)  # planted in the hub cache
    with pytest.raises(CheckpointError, match="does not match the published SHA-256") as info:
        build_trunk("bn_inception", pretrained=True)
    _one_line_refusal(info.value)
    assert not marker.exists()


def test_torchvision_cache_file_is_hash_checked_before_loading(tmp_path, hub):
    import torchvision

    url = torchvision.models.get_model_weights("resnet18").DEFAULT.url
    marker = tmp_path / "ran"
    hub.mkdir(parents=True)
    _malicious(hub / Path(url).name, marker)
    with pytest.raises(CheckpointError, match=f"SHA-256 prefix {published_sha256_prefix(url)}"):
        build_trunk("resnet18", pretrained=True)
    assert not marker.exists()


def test_downloads_are_https_and_checked(tmp_path, monkeypatch):
    assert BN_INCEPTION_URL.startswith("https://")
    assert BN_INCEPTION_SHA256.startswith(published_sha256_prefix(BN_INCEPTION_URL))
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buf)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    calls = []

    def fake_download(url, dst, hash_prefix=None, progress=True):
        calls.append(url)
        Path(dst).write_bytes(payload)

    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download)
    url = f"https://example.org/w-{digest[:10]}.pth"
    path = fetch_weights(url, cache_dir=tmp_path)  # prefix from the file name
    assert path == tmp_path / f"w-{digest[:10]}.pth" and load_weights_file(path)["w"][3] == 3
    assert fetch_weights(url, cache_dir=tmp_path) == path and len(calls) == 1  # cached, checked
    wrong = "0" * 64
    with pytest.raises(CheckpointError, match="does not match"):
        fetch_weights("https://example.org/x.pth", wrong, cache_dir=tmp_path / "b")
    assert list((tmp_path / "b").iterdir()) == []  # the bad download is deleted
    with pytest.raises(ConfigError, match="no published SHA-256"):
        fetch_weights("https://example.org/unnamed.pth", cache_dir=tmp_path)
