"""``dmlkit evaluate``: files in, table or JSON out, exit code 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dmlkit.cli import main
from dmlkit.embeddings import save_embeddings
from dmlkit.metrics import evaluate


@pytest.fixture()
def emb_files(tmp_path):
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(8), 6)
    x = (rng.normal(size=(8, 5))[y] + 0.7 * rng.normal(size=(48, 5))).astype(np.float32)
    ref_y = np.repeat(np.arange(8), 3)
    ref_x = (rng.normal(size=(24, 5))).astype(np.float32)
    save_embeddings(tmp_path / "q.npz", x, y)
    save_embeddings(tmp_path / "r.npz", ref_x, ref_y)
    np.save(tmp_path / "q.npy", x)
    np.savetxt(tmp_path / "labels.txt", y, fmt="%d")
    torch.save({"embeddings": torch.from_numpy(x), "labels": torch.from_numpy(y)}, tmp_path / "q.pt")
    return tmp_path, x, y, ref_x, ref_y


def run(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output_matches_evaluate(emb_files, capsys):
    tmp, x, y, *_ = emb_files
    code, out, _ = run(["evaluate", str(tmp / "q.npz"), "--json", "--metrics",
                        "precision_at_1,r_precision,map_at_r,recall_at_k", "--k", "1,3"], capsys)
    assert code == 0
    got = json.loads(out)
    want = evaluate(x, y, metrics=["precision_at_1", "r_precision", "map_at_r", "recall_at_k"],
                    k_values=(1, 3))
    assert got == pytest.approx(want)
    assert list(got)[-2:] == ["num_queries", "num_queries_without_positive"]


def test_repeated_list_options_add_up(emb_files, capsys):
    """``-m a -m b`` is ``-m a,b`` (a second use used to replace the first, silently dropping a
    requested metric); so are ``--k``."""
    tmp, *_ = emb_files
    code, joined, _ = run(["evaluate", str(tmp / "q.npz"), "--json", "-m", "map,map_at_r,recall_at_k",
                           "--k", "1,3"], capsys)
    assert code == 0
    code, repeated, _ = run(["evaluate", str(tmp / "q.npz"), "--json", "-m", "map", "-m",
                             "map_at_r", "--metrics", "recall_at_k", "--k", "1", "--k", "3"], capsys)
    assert code == 0
    assert list(json.loads(repeated)) == ["map", "map_at_r", "recall_at_1", "recall_at_3",
                                          "num_queries", "num_queries_without_positive"]
    assert json.loads(repeated) == json.loads(joined)


def test_listed_option_values():
    from dmlkit.commands._options import listed

    assert listed(["map, map_at_r", "", "nmi,", " ami "]) == ["map", "map_at_r", "nmi", "ami"]
    assert listed([]) == []


@pytest.mark.parametrize("source", ["q.pt", "q.npy"])
def test_other_formats_give_same_numbers(emb_files, capsys, source):
    tmp, *_ = emb_files
    base = run(["evaluate", str(tmp / "q.npz"), "--json"], capsys)[1]
    extra = ["--labels", str(tmp / "labels.txt")] if source.endswith(".npy") else []
    code, out, _ = run(["evaluate", str(tmp / source), "--json", *extra], capsys)
    assert code == 0 and json.loads(out) == json.loads(base)


def test_reference_table_and_per_class(emb_files, capsys):
    tmp, x, y, rx, ry = emb_files
    per_class_path = tmp / "per_class.json"
    code, out, _ = run(["evaluate", str(tmp / "q.npz"), "--reference", str(tmp / "r.npz"),
                        "--metrics", "map_at_r,precision_at_1", "--per-class", str(per_class_path)],
                       capsys)
    assert code == 0
    assert "map_at_r" in out and "q.npz vs r.npz" in out and "48 queries" in out
    want = evaluate(x, y, rx, ry, metrics=["map_at_r"])["map_at_r"]
    assert f"{100 * want:.2f}" in out
    table = json.loads(per_class_path.read_text())
    assert set(table) == {str(c) for c in range(8)} and "map_at_r" in table["0"]


def test_clustering_and_histogram_metrics(emb_files, capsys):
    tmp, *_ = emb_files
    code, out, _ = run(["evaluate", str(tmp / "q.npz"), "--json", "--metrics", "nmi,pair_f1,pos_neg_js",
                        "--restarts", "1"], capsys)
    assert code == 0
    res = json.loads(out)
    assert 0 <= res["nmi"] <= 1 and 0 <= res["pos_neg_js"] <= 1


def test_bad_inputs_exit_2(emb_files, capsys):
    tmp, x, y, *_ = emb_files
    code, _, err = run(["evaluate", str(tmp / "missing.npz")], capsys)
    assert code == 2 and "not found" in err
    bad = x.copy()
    bad[3, 0] = np.nan
    save_embeddings(tmp / "nan.npz", bad, y)
    code, _, err = run(["evaluate", str(tmp / "nan.npz")], capsys)
    assert code == 2 and "NaN" in err and "Traceback" not in err
    code, _, err = run(["evaluate", str(tmp / "q.npz"), "--metrics", "accuracy"], capsys)
    assert code == 2 and "unknown metric" in err
    code, _, err = run(["evaluate", str(tmp / "q.npy")], capsys)  # no labels
    assert code == 2 and "labels" in err
    code, _, err = run(["evaluate", str(tmp / "q.npz"), "--k", "one"], capsys)
    assert code == 2


def test_console_script_exit_code(emb_files):
    """The real entry point: a user error prints one line and exits 2, no traceback."""
    tmp, *_ = emb_files
    bad = subprocess.run([sys.executable, "-m", "dmlkit", "evaluate", str(tmp / "nope.npy")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not found" in bad.stderr and "Traceback" not in bad.stderr


def test_labels_are_validated_not_cast(emb_files, capsys):
    """Issue 11.2: fractional or NaN labels exit 2 with one line (never truncated to one class);
    string labels are class names, kept in the per-class output."""
    tmp, x, y, *_ = emb_files
    np.savez(tmp / "frac.npz", embeddings=x, labels=(y % 10) / 10)
    code, _, err = run(["evaluate", str(tmp / "frac.npz")], capsys)
    assert code == 2 and "fractional" in err and "Traceback" not in err
    np.savez(tmp / "nanlab.npz", embeddings=x, labels=np.where(y == 3, np.nan, y))
    code, _, err = run(["evaluate", str(tmp / "nanlab.npz")], capsys)
    assert code == 2 and "NaN" in err
    names = np.array([f"species {c}" for c in y])
    (tmp / "names.txt").write_text("\n".join(names) + "\n")
    base = json.loads(run(["evaluate", str(tmp / "q.npz"), "--json"], capsys)[1])
    code, out, _ = run(["evaluate", str(tmp / "q.npy"), "--labels", str(tmp / "names.txt"), "--json",
                        "--per-class", str(tmp / "pc.json")], capsys)
    assert code == 0 and json.loads(out) == base
    table = json.loads((tmp / "pc.json").read_text())
    assert sorted(table) == sorted(set(names.tolist()))
    np.savez(tmp / "named.npz", embeddings=x, labels=names)
    assert json.loads(run(["evaluate", str(tmp / "named.npz"), "--json"], capsys)[1]) == base


def test_scale_overflow_exits_2(emb_files, capsys):
    """Issue 11.3: cosine is scale-invariant; an unnormalised distance (SNR) that would overflow
    refuses."""
    tmp, x, y, *_ = emb_files
    np.savez(tmp / "huge.npz", embeddings=x * np.float32(1e19), labels=y)
    base = json.loads(run(["evaluate", str(tmp / "q.npz"), "--json"], capsys)[1])
    assert json.loads(run(["evaluate", str(tmp / "huge.npz"), "--json"], capsys)[1]) == base
    code, _, err = run(["evaluate", str(tmp / "huge.npz"), "--distance", "snr"], capsys)
    assert code == 2 and "too large" in err and "Traceback" not in err


def test_device_option(emb_files, capsys, monkeypatch):
    """``--device``: cpu by default; auto is the CPU without a GPU (same numbers); cuda without a
    GPU, an unknown device and a GPU for a streamed shard directory are one-line errors. The
    GPU's numbers are checked against the CPU's in tests/test_cuda.py."""
    tmp, *_ = emb_files
    argv = ["evaluate", str(tmp / "q.npz"), "--json", "-m", "map_at_r,map,nmi,pos_neg_js"]
    code, cpu, _ = run(argv, capsys)
    assert code == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, auto, _ = run(argv + ["--device", "auto"], capsys)
    assert code == 0 and json.loads(auto) == json.loads(cpu)
    code, _, err = run(argv + ["--device", "cuda"], capsys)
    assert code == 2 and "no CUDA GPU is available" in err and "Traceback" not in err
    code, _, err = run(argv + ["--device", "bogus"], capsys)
    assert code == 2 and "unknown device 'bogus'" in err and "Traceback" not in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from dmlkit.embedding_shards import write_shards

    write_shards(tmp / "shards", *[np.asarray(a) for a in emb_files[1:3]])
    code, _, err = run(["evaluate", str(tmp / "shards"), "--device", "cuda"], capsys)
    assert code == 2 and "streamed through the CPU" in err


def test_per_class_under_a_file_says_a_file_is_in_the_way(emb_files, capsys):
    """`--per-class afile/pc.json` with afile a file: "cannot access afile: File exists" (the
    folder's EEXIST, no hint) became the "a file is in the way" line of the other outputs."""
    tmp, *_ = emb_files
    (tmp / "afile").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", str(tmp / "q.npz"), "--per-class", str(tmp / "afile" / "pc.json")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "afile: Not a directory (a file is in the way where a directory is needed)" in err


# -- query items that the reference set holds too (by the paths both files record) -------------
def _same_items(tmp_path, shift: float = 1e-5):
    """Query and reference files of the same 24 items (one path each), the reference's
    vectors moved by ``shift`` (another device's, or another model's, embeddings of them)."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(6), 4)
    x = rng.normal(size=(24, 8)).astype(np.float32)
    paths = np.asarray([f"c{c}/{i}.png" for c in range(6) for i in range(4)])
    save_embeddings(tmp_path / "q.npz", x, y, paths=paths)
    ref = (x + shift * rng.normal(size=x.shape)).astype(np.float32)
    save_embeddings(tmp_path / "r.npz", ref, y, paths=paths)
    return x, ref, y, paths


def test_query_items_in_the_reference_set_are_refused_not_counted(tmp_path, run_cli):
    """Each query found its own image's other embedding at rank 1: P@1 100 % (16.7 % left out of
    its own neighbours) with exit 0 and no warning, as the rows were not bit-identical."""
    x, _, y, _ = _same_items(tmp_path)
    code, out, err = run_cli(["evaluate", str(tmp_path / "q.npz"), "-r", str(tmp_path / "r.npz"),
                              "-m", "precision_at_1", "--json"])
    assert code == 2 and out == "", out
    line = err.strip()
    assert line.startswith("error: 24 of the 24 query items are also in the reference set") and "\n" not in line
    assert "'c0/0.png'" in line and "--shared-items drop" in line and "--shared-items keep" in line
    # drop: nothing would be left; keep: the number as it was, with the count said
    code, _, err = run_cli(["evaluate", str(tmp_path / "q.npz"), "-r", str(tmp_path / "r.npz"),
                            "-m", "precision_at_1", "--shared-items", "drop"])
    assert code == 2 and "every reference item is one of them" in err
    code, out, err = run_cli(["evaluate", str(tmp_path / "q.npz"), "-r", str(tmp_path / "r.npz"),
                              "-m", "precision_at_1", "--json", "--shared-items", "keep"])
    assert code == 0 and json.loads(out)["precision_at_1"] == 1.0
    assert err.startswith("warning: 24 of the 24 query items") and "(--shared-items keep)" in err


def test_items_are_shared_by_path_and_label_not_by_path_alone(tmp_path, run_cli):
    """Two data sets with the same ``cN/i.png`` layout (other classes under those folders, other
    vectors) were refused as sharing every item, by their relative paths alone."""
    rng = np.random.default_rng(1)
    y = np.repeat(np.arange(6), 4)
    paths = np.asarray([f"c{c}/{i}.png" for c in range(6) for i in range(4)])
    x, other = (rng.normal(size=(24, 8)).astype(np.float32) for _ in range(2))
    save_embeddings(tmp_path / "q.npz", x, y, paths=paths)
    save_embeddings(tmp_path / "b.npz", other, (y + 1) % 6, paths=paths)  # ids: other classes at those paths
    names = np.asarray([f"n{c}" for c in range(6)])
    save_embeddings(tmp_path / "qn.npz", x, names[y], paths=paths)
    save_embeddings(tmp_path / "bn.npz", other, names[(y + 1) % 6], paths=paths)  # names: likewise
    for query, ref in (("q", "b"), ("qn", "bn")):
        code, out, err = run_cli(["evaluate", str(tmp_path / f"{query}.npz"), "-r", str(tmp_path / f"{ref}.npz"),
                                  "-m", "precision_at_1", "--json"])
        assert code == 0 and "query items" not in err, err
        assert json.loads(out)["num_queries"] == 24
    # the same items under another code table of the same names: shared (names, not codes, compared)
    save_embeddings(tmp_path / "rn.npz", other, (5 - y).astype(np.int64), paths=paths, class_names=names[::-1])
    code, _, err = run_cli(["evaluate", str(tmp_path / "qn.npz"), "-r", str(tmp_path / "rn.npz"),
                            "-m", "precision_at_1"])
    assert code == 2 and "24 of the 24 query items are also in the reference set" in err, err


def test_shared_items_drop_leaves_them_out_of_the_reference_set(tmp_path, run_cli):
    x, ref, y, paths = _same_items(tmp_path, shift=0.5)
    save_embeddings(tmp_path / "q10.npz", x[:10], y[:10], paths=paths[:10])  # a gallery holding the queries
    code, out, err = run_cli(["evaluate", str(tmp_path / "q10.npz"), "-r", str(tmp_path / "r.npz"),
                              "-m", "precision_at_1,map_at_r", "--json", "--shared-items", "drop"])
    assert code == 0, err
    assert "left the 10 reference items that are query items out of" in err
    want = evaluate(x[:10], y[:10], ref[10:], y[10:], metrics=["precision_at_1", "map_at_r"])
    assert json.loads(out) == pytest.approx(want)
    # a reference file without paths: nothing to match (no error), and --shared-items is refused as unused
    save_embeddings(tmp_path / "plain.npz", ref, y)
    code, out, _ = run_cli(["evaluate", str(tmp_path / "q10.npz"), "-r", str(tmp_path / "plain.npz"),
                            "-m", "precision_at_1", "--json"])
    assert code == 0 and json.loads(out)["num_queries"] == 10
    code, _, err = run_cli(["evaluate", str(tmp_path / "q10.npz"), "-r", str(tmp_path / "plain.npz"),
                            "--shared-items", "drop"])
    assert code == 2 and "do not both record them: drop --shared-items" in err
