"""``dmlkit track evaluate --dataset got10k`` without ``--split`` on a GOT-10k root that holds
split folders scored ``train`` - the split trackers learn from - and said nothing. It now asks
for the split; a root that holds the sequences themselves, or a named split, runs as before."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from dmlkit.apps.tracking import got10k_splits
from dmlkit.apps.tracking.offline import make_sequence, offline_specs


def _got10k_sequence(folder, seed: int) -> None:
    seq = make_sequence(offline_specs("train", 1, num_frames=4, seed=seed, frame_size=(128, 96))[0])
    folder.mkdir(parents=True)
    for i, frame in enumerate(seq.frames):
        Image.fromarray(frame).save(folder / f"{i + 1:08d}.jpg", quality=95)
    (folder / "groundtruth.txt").write_text("\n".join(",".join(f"{v:.2f}" for v in b) for b in seq.boxes))


def test_evaluate_without_split_on_a_root_with_splits_asks_for_one(tmp_path, run_cli):
    root = tmp_path / "GOT-10k"
    _got10k_sequence(root / "train" / "GOT-10k_Train_000001", 1)
    _got10k_sequence(root / "val" / "GOT-10k_Val_000001", 2)
    (root / "notes").mkdir()  # not a split: no sequence inside
    assert got10k_splits(root) == ["train", "val"]
    assert got10k_splits(root / "train") == [] and got10k_splits(tmp_path / "missing") == []
    code, out, err = run_cli(["track", "evaluate", str(root), "--dataset", "got10k", "--methods", "ncc"])
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()]
    assert "holds the GOT-10k splits train, val: name the one to evaluate with --split" in err
    code, out, err = run_cli(["track", "evaluate", str(root), "--dataset", "got10k", "--split", "val",
                              "--methods", "ncc", "--json"])
    assert code == 0, err
    assert json.loads(out)["ncc"]["num_sequences"] == 1
    # a root that is the split folder itself needs no --split
    code, out, err = run_cli(["track", "evaluate", str(root / "val"), "--dataset", "got10k",
                              "--methods", "ncc", "--json"])
    assert code == 0, err
    assert np.isfinite(json.loads(out)["ncc"]["success_auc"])
