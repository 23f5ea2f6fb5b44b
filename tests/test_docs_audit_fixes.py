"""Fixes from the documentation-truth pass (docs/*.md commands and snippets run as written)."""

from __future__ import annotations

import warnings

import numpy as np

from dmlkit.embedding_shards import ShardWriter, open_shards


def test_float16_shard_writer_warns_once_for_all_batches(tmp_path):
    # docs/search.md: values below float16's smallest normal "give a warning". `dmlkit embed
    # --format shards --dtype float16` appends one batch at a time; each batch used to warn with
    # its own count (a dozen lines for the quickstart's test split), never the total.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ShardWriter(tmp_path / "h", dtype="float16", shard_rows=4) as w:
            for count in (1, 2, 3):  # three batches with 1, 2 and 3 tiny values
                batch = np.full((3, 4), 0.5, np.float32)
                batch.flat[:count] = 1e-6
                w.append(batch, [0, 1, 2])
    messages = [str(c.message) for c in caught if "smallest normal" in str(c.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith("6 of 36 embedding values are below float16's smallest normal")
    assert open_shards(tmp_path / "h").shape == (9, 4)


def test_float16_shard_writer_that_fails_does_not_warn(tmp_path):
    # a writer left by an exception writes no manifest, and no summary warning either
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with ShardWriter(tmp_path / "h", dtype="float16") as w:
                w.append(np.full((2, 4), 1e-6, np.float32), [0, 1])
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
    assert not [c for c in caught if "smallest normal" in str(c.message)]
