"""The report draws what it can and says why a panel is missing, on any completed run:
a one-class split (no negative pair), a split too small for a 2-D map."""

from __future__ import annotations

import numpy as np

from dmlkit.report.builder import ReportOptions, _embedding_sections, _Split


def _split(name: str, classes: int, per_class: int, seed: int) -> _Split:
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(classes), per_class)
    centres = rng.normal(size=(classes, 8))
    emb = (centres[labels] + 0.3 * rng.normal(size=(labels.size, 8))).astype(np.float32)
    return _Split(name, emb, labels)


def test_one_class_validation_split_is_reported_not_fatal(tmp_path):
    test = _split("test", 6, 5, 0)
    val = _split("val", 1, 5, 1)  # one validation class: no negative pair
    tiny = _split("train", 1, 2, 2)  # two samples: no negative pair, nothing to project
    sections = _embedding_sections(test, None, {"val": val, "train": tiny}, tmp_path,
                                   ReportOptions(maps=("pca", "tsne"), thumbnails=False), "the run")
    by_title = {s.title: s for s in sections}
    hist = by_title["Positive and negative pair similarities"]
    table = "".join(hist.html_blocks)
    assert "val, after training" in table and "not drawn" in table and "negative" in table
    assert hist.figures, "the test split's histogram is still drawn"
    assert (tmp_path / "histograms.png").exists()
    assert "Retrieval gallery" in by_title and "Per-class MAP@R" in by_title


def test_too_few_test_samples_for_a_map_say_so(tmp_path):
    test = _split("test", 1, 3, 0)  # one class of three: no negative pair, too few to project
    sections = _embedding_sections(test, None, {}, tmp_path,
                                   ReportOptions(maps=("pca",), thumbnails=False), "the run")
    by_title = {s.title: s for s in sections}
    maps = by_title["Maps of the test embeddings"]
    assert not maps.figures and any("too few" in p for p in maps.paragraphs)
    assert not by_title["Positive and negative pair similarities"].figures
