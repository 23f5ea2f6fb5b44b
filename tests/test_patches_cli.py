"""End to end: `dmlkit patches train | evaluate` on two small real subsets, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dmlkit.apps.patches.offline import OfflineSpec, build_offline_subset
from dmlkit.cli import main


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("patchdata")
    spec = OfflineSpec(points_per_subset=48, views=3, train_pairs=256, test_pairs=100, seed=1)
    build_offline_subset(root / "photos", "photos", spec, sources=("camera",))
    build_offline_subset(root / "textures", "textures", spec, sources=("brick",))
    return root


def _config(path: Path, root: Path, **training) -> Path:
    cfg = {
        "seed": 0,
        "data": {"root": str(root), "combinations": [["photos", "textures"], ["textures", "photos"]]},
        "model": {"architectures": ["2ch", "siam-l2", "hardnet"], "patch_size": 32, "width": 0.125},
        "training": {"epochs": 1, "batch_size": 64, "threads": 1, **training},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_train_then_evaluate(data: Path, tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path / "p.yaml", data)
    run = tmp_path / "run"
    code, out, err = _run(["patches", "train", str(cfg), "-o", str(run), "--json"], capsys)
    assert code == 0, err
    table = json.loads(out)
    assert table["architectures"] == ["2ch", "siam-l2", "hardnet"]
    assert [(r["train"], r["test"]) for r in table["rows"]] == [("photos", "textures"), ("textures", "photos")]
    for r in table["rows"]:
        for a in table["architectures"]:
            assert 0.0 <= r[a]["fpr95"] <= 1.0 and 0.0 <= r[a]["roc_auc"] <= 1.0
    for a in table["architectures"]:
        assert table["mean"][a]["fpr95"] == pytest.approx(sum(r[a]["fpr95"] for r in table["rows"]) / 2)
    for f in ("results.json", "results.md", "config.yaml", "provenance.json", "models/2ch/photos.pt", "scores/hardnet/textures__photos.npz"):
        assert (run / f).is_file(), f
    # the networks trained channels-last on the CPU (dmlkit.models.to_device; the checkpoint keeps
    # the strides): 0.32-0.92x the default layout's time (benchmarks/README.md)
    import torch

    state = torch.load(run / "models/2ch/photos.pt", weights_only=True)["state_dict"]
    convs = [v for k, v in state.items() if v.ndim == 4 and v.shape[1] > 1]
    assert convs and all(v.is_contiguous(memory_format=torch.channels_last) for v in convs)
    # the stored table, the re-scored checkpoints (same pairs, same numbers) and the figure
    code, out, _ = _run(["patches", "evaluate", str(run), "--json"], capsys)
    assert code == 0 and json.loads(out)["rows"] == table["rows"]
    code, out, _ = _run(["patches", "evaluate", str(run), "--rescore", "--json"], capsys)
    rescored = json.loads(out)
    for r, q in zip(rescored["rows"], table["rows"]):
        for a in table["architectures"]:
            assert r[a]["fpr95"] == pytest.approx(q[a]["fpr95"], abs=1e-12)
    fig = tmp_path / "hard.png"
    code, out, err = _run(["patches", "evaluate", str(run), "--figure", str(fig), "--arch", "2ch", "-k", "4"], capsys)
    assert code == 0, err
    assert fig.stat().st_size > 1000 and "2ch" in out and "mean" in out
    # a figure that cannot be written: one error line and nothing on stdout (the table came first)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, out, err = _run(["patches", "evaluate", str(run), "--figure", str(blocker / "hard.png")], capsys)
    assert code == 2 and out == "" and "a_file" in err
    # --json: stdout is the JSON alone (the figure's line goes to stderr)
    code, out, err = _run(["patches", "evaluate", str(run), "--figure", str(fig), "--json"], capsys)
    assert code == 0 and json.loads(out)["rows"] == table["rows"] and "figure ->" in err
    # resuming loads the checkpoints instead of training again
    code, _, err = _run(["patches", "train", str(cfg), "-o", str(run)], capsys)
    assert code == 0 and "loaded" in err


def test_errors_exit_2(data: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {architectures: [3ch]}\ndata: {root: " + str(data) + ", combinations: [[photos, textures]]}\n")
    code, _, err = _run(["patches", "train", str(bad), "-o", str(tmp_path / "r")], capsys)
    assert code == 2 and "unknown patch architecture" in err
    cfg = _config(tmp_path / "p.yaml", tmp_path / "nothing")
    code, _, err = _run(["patches", "train", str(cfg), "-o", str(tmp_path / "r2")], capsys)
    assert code == 2 and "build-data" in err
    # a missing *test* subset is found before the first model trains, and nothing is written
    partial = _config(tmp_path / "partial.yaml", data)
    code, _, err = _run(["patches", "train", str(partial), "-o", str(tmp_path / "r4"),
                         "--set", "data.combinations=[[photos, stereo]]"], capsys)
    assert code == 2 and "patch subset 'stereo' not found" in err and not (tmp_path / "r4").exists()
    code, _, err = _run(["patches", "train", str(cfg), "-o", str(tmp_path / "r3"), "--set", "training.nope=1"], capsys)
    assert code == 2 and "nope" in err
    code, _, err = _run(["patches", "evaluate", str(tmp_path)], capsys)
    assert code == 2 and "patches train" in err


def test_shipped_configs_validate(tmp_path: Path) -> None:
    from dmlkit.apps.patches import build_patch_model, load_patch_config
    from dmlkit.apps.patches.protocol import subsets_root

    repo = Path(__file__).resolve().parents[1]
    brown = load_patch_config(repo / "configs" / "patches_brown.yaml")
    assert len(brown.data.combinations) == 6 and brown.data.test_pairs == 100000
    assert subsets_root(brown, tmp_path) == tmp_path / "phototour"
    offline = load_patch_config(repo / "configs" / "patches_offline.yaml", ["training.epochs=1"])
    assert offline.training.epochs == 1 and subsets_root(offline, tmp_path) == tmp_path / "patches_offline"
    assert {a for a, _ in offline.data.combinations} == {"stereo", "photos", "textures"}
    for cfg in (brown, offline):
        for arch in cfg.model.architectures:
            build_patch_model(arch, cfg.model.patch_size, cfg.model.width)


def test_build_data_command(tmp_path: Path, capsys) -> None:
    out = tmp_path / "offline"
    argv = ["patches", "build-data", "-o", str(out), "--subset", "photos", "--points", "20", "--views", "2",
            "--train-pairs", "40", "--test-pairs", "20", "--seed", "5"]
    code, stdout, err = _run(argv, capsys)
    assert code == 0, err
    assert "photos: 20 points, 40 patches" in stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spec"]["seed"] == 5 and list(manifest["subsets"]) == ["photos"]
    assert set(manifest["subsets"]["photos"]["sha256"]) == {"info.txt", "m50_40_40_0.txt", "m50_20_20_0.txt", "patches0000.bmp"}
    # a second subset into the same root keeps the first one's record (and its settings)
    code, stdout, err = _run([*argv[:5], "stereo", *argv[6:-1], "6"], capsys)
    assert code == 0, err
    assert "stereo: 20 points" in stdout and "photos" not in stdout
    both = json.loads((out / "manifest.json").read_text())
    assert list(both["subsets"]) == ["photos", "stereo"] and both["spec"]["seed"] == 6
    assert both["subsets"]["photos"] == {**manifest["subsets"]["photos"], "spec": manifest["spec"],
                                         "scikit_image": manifest["scikit_image"]}
    assert both["subsets"]["stereo"]["spec"]["seed"] == 6
    code, _, err = _run([*argv[:3], str(tmp_path / "x"), "--subset", "liberty"], capsys)
    assert code == 2 and "unknown offline subset" in err


@pytest.mark.parametrize("override, key", [
    ("training.lr=-1.0", "training.lr"), ("training.epochs=0", "training.epochs"),
    ("training.device=gpu", "training.device"), ("training.optimizer=adamm", "training.optimizer"),
    ("training.threads=0", "training.threads"), ("training.decision_output=sigmoid", "training.decision_output"),
    ("training.epochs.x=1", "training.epochs"), ("data.max_test_pairs=0", "data.max_test_pairs"),
])
def test_bad_patch_settings_are_refused_when_the_config_is_read(override, key):
    """Each was a traceback (a negative learning rate, `--set` into a value) or an error after
    the run directory was written; now one ConfigError naming the key, before any work."""
    from dmlkit.apps.patches import load_patch_config
    from dmlkit.exceptions import ConfigError

    repo = Path(__file__).resolve().parents[1]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_patch_config(repo / "configs" / "patches_offline.yaml", [override])
