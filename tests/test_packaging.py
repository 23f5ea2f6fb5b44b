"""Packaging and installation (audit s41): provenance's git commit, the license metadata, the
declared torch bound, one-line errors for missing optional packages, and the packaged presets."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from dmlkit.config import load_config
from dmlkit.exceptions import ConfigError, DependencyError

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")
needs_pyproject = pytest.mark.skipif(not PYPROJECT.is_file(), reason="needs the source tree")


def _hide(monkeypatch: pytest.MonkeyPatch, *top_level: str) -> None:
    """Import as if the distributions ``top_level`` were not installed: every meta-path finder
    finds nothing for them (``import`` raises the ordinary ModuleNotFoundError), and modules
    already imported from them (or holding them, as imageio's PyAV plugin holds ``av``) are
    dropped for the test. ``monkeypatch`` puts all of it back."""
    hidden = set(top_level)

    class Hide:
        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in hidden:
                return None
            find = getattr(self.inner, "find_spec", None)
            return find(name, path, target) if find else None

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

    for name in list(sys.modules):
        if name.split(".")[0] in hidden or name == "imageio.plugins.pyav":
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Hide(f) for f in sys.meta_path])


# -- F1: provenance.json's git_commit ---------------------------------------------------------
def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def _repo_with(tmp_path: Path, files: dict[str, str]) -> Path:
    repo = tmp_path / "proj"
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "init")
    return repo


@needs_git
def test_git_commit_is_none_for_an_installed_copy_inside_a_users_repository(tmp_path):
    """dmlkit installed into ``.venv/`` inside a user's git project: git walked up from
    site-packages and provenance recorded the *user's* HEAD as dmlkit's commit."""
    from dmlkit.provenance import _git_commit

    site = ".venv/lib/python3.11/site-packages/dmlkit"
    repo = _repo_with(tmp_path, {"pyproject.toml": '[project]\nname = "userapp"\n',
                                 "app.py": "print(1)\n", f"{site}/__init__.py": ""})
    assert _git(repo, "rev-parse", "HEAD")  # the user's project has a commit ...
    assert _git_commit(repo / site) is None  # ... which is not dmlkit's


@needs_git
def test_git_commit_is_none_when_src_dmlkit_belongs_to_another_project(tmp_path):
    from dmlkit.provenance import _git_commit

    repo = _repo_with(tmp_path, {"pyproject.toml": '[project]\nname = "other"\n',
                                 "src/dmlkit/__init__.py": ""})
    assert _git_commit(repo / "src" / "dmlkit") is None


@needs_git
def test_git_commit_of_a_dmlkit_source_checkout(tmp_path):
    from dmlkit.provenance import _git_commit

    repo = _repo_with(tmp_path, {"pyproject.toml": '[project]\nname = "dmlkit"\n',
                                 "src/dmlkit/__init__.py": ""})
    head = _git(repo, "rev-parse", "HEAD")
    assert _git_commit(repo / "src" / "dmlkit") == head
    (repo / "src" / "dmlkit" / "__init__.py").write_text("x = 1\n")
    assert _git_commit(repo / "src" / "dmlkit") == head + "-dirty"


# -- F2, F3: pyproject metadata -------------------------------------------------------------
@needs_pyproject
def test_license_is_an_spdx_expression_with_its_file():
    """``license = {text = ...}`` is deprecated (setuptools refuses it after 2027-02-18)."""
    meta = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    assert meta["project"]["license"] == "MIT"
    assert meta["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in meta["build-system"]["requires"]
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License") and "the dmlkit authors" in text


@needs_pyproject
def test_declared_torch_bound_covers_the_apis_used():
    """GradScaler("cuda") needs torch 2.3, onnx.export(dynamo=False) 2.5; bounds, not pins."""
    deps = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    assert "torch>=2.5" in deps and "torchvision>=0.20" in deps
    assert not [d for d in deps if "==" in d]  # exact pins live in .ci/constraints.txt


# -- F4, F8: a missing optional package is one line naming the extra -----------------------------
def test_writing_a_video_without_pyav_names_the_tracking_extra(tmp_path, monkeypatch):
    pytest.importorskip("imageio")
    from dmlkit.apps.tracking.render import write_frames

    _hide(monkeypatch, "av")
    frames = [np.zeros((16, 16, 3), np.uint8)] * 2
    with pytest.raises(DependencyError, match=r"pip install 'dmlkit\[tracking\]'"):
        write_frames(frames, tmp_path / "t.mp4")
    assert not (tmp_path / "t.mp4").exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # imageio's legacy plugins, tried in turn
def test_reading_a_video_without_pyav_names_the_tracking_extra(tmp_path, monkeypatch):
    pytest.importorskip("imageio")
    pytest.importorskip("av")
    from dmlkit.apps.tracking.datasets import read_video
    from dmlkit.apps.tracking.render import write_frames

    rng = np.random.default_rng(0)
    video = write_frames([rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(3)],
                         tmp_path / "v.mp4")
    assert len(read_video(video)[0]) == 3
    _hide(monkeypatch, "av")
    with pytest.raises(DependencyError, match=r"pip install 'dmlkit\[tracking\]'") as info:
        read_video(video)
    assert "damaged" not in str(info.value)


def test_faiss_kmeans_without_faiss_names_the_faiss_extra(monkeypatch):
    from dmlkit.metrics.clustering import cluster_metrics, kmeans_labels

    _hide(monkeypatch, "faiss")
    x = np.random.default_rng(0).normal(size=(50, 8)).astype(np.float32)
    with pytest.raises(DependencyError, match=r"pip install 'dmlkit\[faiss\]'"):
        kmeans_labels(x, 5, backend="faiss")
    with pytest.raises(DependencyError, match=r"pip install 'dmlkit\[faiss\]'"):
        cluster_metrics(x, np.arange(50) % 5, backend="faiss")


# -- F5: the presets ship in the package and resolve by name ------------------------------------
PRESETS = ("att_faces_efficientnet att_faces_reid bench_cars196 bench_cub200 bench_quick bench_sop "
           "cars196 cub200 market1501 patches_brown patches_offline quickstart siamfc_got10k "
           "siamfc_offline sop").split()


@needs_pyproject
def test_package_data_names_the_packaged_presets():
    """``configs/*.yaml`` was package data, but the presets sat outside the package: the wheel
    carried none, and a pip install could not run the README's quickstart."""
    import dmlkit

    package = Path(dmlkit.__file__).parent
    patterns = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]["dmlkit"]
    shipped = {p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()}
    for pattern in patterns:
        assert fnmatch.filter(shipped, pattern), f"package data {pattern!r} matches no file"
    assert sorted(Path(p).stem for p in fnmatch.filter(shipped, "configs/*.yaml")) == PRESETS
    if (REPO / "configs").is_symlink():  # the repository's configs/ is the package's
        assert (REPO / "configs").resolve() == (package / "configs").resolve()


@pytest.mark.parametrize("name", ["quickstart", "quickstart.yaml"])
def test_a_preset_name_resolves_to_the_packaged_file(tmp_path, monkeypatch, name):
    from dmlkit.config_yaml import PRESET_DIR

    monkeypatch.chdir(tmp_path)  # no such file here
    assert load_config(name) == load_config(PRESET_DIR / "quickstart.yaml")


def test_every_config_reader_takes_a_preset_name(tmp_path, monkeypatch):
    from dmlkit.apps.patches.protocol import load_patch_config
    from dmlkit.apps.tracking.training import SiamFCTrainConfig
    from dmlkit.protocol import load_bench_config

    monkeypatch.chdir(tmp_path)
    assert load_bench_config("bench_quick").methods
    assert load_patch_config("patches_offline").seed is not None
    assert SiamFCTrainConfig.from_yaml("siamfc_offline").data_dir


def test_an_unknown_name_lists_the_presets(tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config("quikstart")
    message = str(info.value)
    assert all(name in message for name in PRESETS) and "see configs/" not in message
    code, _, err = run_cli(["train", "quikstart"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "quickstart" in err, err


def test_a_local_file_wins_over_the_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart.yaml").write_text("data: {dataset: omniglot}\nloss: {name: triplet}\ntraining: {epochs: 3}\n")
    assert load_config("quickstart.yaml").training.epochs == 3
    # the README's promise: the bare name reads the edited local copy too (it read the preset)
    assert load_config("quickstart").training.epochs == 3
    assert load_config("cub200").model.trunk == "bn_inception"  # no local cub200.yaml: the preset
    with pytest.raises(ConfigError, match="not found"):  # a path with a folder is never a preset
        load_config("sub/quickstart.yaml")


def test_a_missing_timm_is_named_not_blamed_on_the_trunk_options(monkeypatch):
    """Hidden timm with trunk options set: the
    preflight said "model.trunk_options ... is refused by trunk ..."; the missing extra is named."""
    from dmlkit.config import ExperimentConfig
    from dmlkit.training.builders import model_setting_problems

    _hide(monkeypatch, "timm")
    config = ExperimentConfig.model_validate({
        "data": {"dataset": "image_folder"}, "loss": {"name": "contrastive"},
        "model": {"trunk": "timm:resnet18", "pretrained": False, "trunk_options": {"drop_rate": 0.1}}})
    with pytest.raises(DependencyError, match=r"dmlkit\[timm\]"):
        model_setting_problems(config)


def test_a_training_preset_given_to_bench_says_so(tmp_path, monkeypatch, run_cli):
    """``dmlkit bench sop`` read the training preset sop.yaml: "data, loss, ... at the top
    level" without saying that the file is a training config and which presets bench takes."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["bench", "sop", "--stage", "search"])
    assert code == 2
    assert "a training config, for `dmlkit train`?" in err and "bench_sop" in err
