"""Where an index's vectors come from, and the checks where files of two sources meet.

An index records in its ``info`` the run whose embeddings it holds (``run_dir``, and ``run``:
the digest of the run's ``provenance.json``, the same for a copy of the run elsewhere;
:func:`dmlkit.apps.index_files.run_facts`), the data root its ids are files under
(``data_root``), the dataset, and the embeddings file it was built from (``source``,
``source_sha256``). Files that meet an index are compared with these
facts, because the same ids and the same dimension say nothing about the embedding space:

* ``dmlkit query`` and ``dmlkit index --add``: the queries' or the new items' facts
  (:func:`dmlkit.apps.index_files.item_ids`) by :func:`source_differences`, and the vectors of
  the ids both hold by :func:`check_shared_vectors`;
* ``dmlkit serve --model``: the model's embeddings of indexed images
  (:func:`check_model_embeds_index`), and ``--verification``: the record of the embeddings its
  threshold was chosen on (:func:`verification_source`, :func:`check_threshold_source`).

One tolerance serves every vector test: :data:`MODEL_INDEX_TOLERANCE`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.apps.index_files import file_under_root, run_facts, run_identity
from dmlkit.exceptions import ConfigError, DataError, DmlkitError
from dmlkit.training import find_checkpoint
from dmlkit.training.run_identity import run_dir_of
from dmlkit.utils import sha256_file

__all__ = ["MODEL_INDEX_TOLERANCE", "check_model_embeds_index", "check_shared_vectors",
           "check_threshold_source", "relative_changes", "source_differences", "verification_source"]

#: Largest relative difference ``|v - stored| / |stored|`` between another embedding of an
#: indexed item and the index's vector of it (exports and devices differ by ~1e-6; another
#: model, checkpoint or image by far more: 131 % for two seeds of one tiny model).
MODEL_INDEX_TOLERANCE = 1e-2
#: Shared ids compared by :func:`check_shared_vectors` (the first ones; a vectorised check).
_SHARED_CHECKED = 4096


def relative_changes(vectors: Any, stored: Any) -> np.ndarray:
    """``|v - s| / |s|`` per row, in float64 (a zero stored row counts its whole difference)."""
    v = np.asarray(vectors, dtype=np.float64).reshape(len(vectors), -1)
    s = np.asarray(stored, dtype=np.float64).reshape(len(stored), -1)
    return np.linalg.norm(v - s, axis=1) / np.maximum(np.linalg.norm(s, axis=1), 1e-30)


def _same_run(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool | None:
    """Whether two sets of facts name one run: by ``run`` (the provenance digest) where both
    have it (an index built before ``run`` was recorded: its folder's provenance when still
    there), else by folder; ``None`` (cannot tell) where the folders differ and a side has no
    digest: an older index whose run was moved (or copied to another machine) with it named
    its own run's files "another run" by their new folder alone."""
    ra = a.get("run") or run_identity(a["run_dir"])
    rb = b.get("run") or run_identity(b["run_dir"])
    if ra and rb:
        return ra == rb
    return True if os.path.realpath(a["run_dir"]) == os.path.realpath(b["run_dir"]) else None


def source_differences(have: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What differs between the source ``have`` (an index's ``info``) and ``new`` (a file's
    facts): the run (the model) and the dataset; a fact only one side records is not compared,
    nor runs that cannot be told apart (:func:`_same_run`; the vectors of shared ids still are).
    The data root is not: a moved copy of the data is the same data (its rows' file sizes are
    checked where it is given, :func:`dmlkit.apps.index_files.item_ids`), and other images under
    the same names are caught by their vectors (:func:`check_shared_vectors`)."""
    out = []
    if "run_dir" in have and "run_dir" in new and _same_run(have, new) is False:
        out.append(f"the run {new['run_dir']}, not {have['run_dir']}")
    if "dataset" in have and "dataset" in new and have["dataset"] != new["dataset"]:
        out.append(f"the dataset {new['dataset']!r}, not {have['dataset']!r}")
    return out


def check_shared_vectors(index: Any, ids: Any, vectors: Any, source: Any, fix: str) -> None:
    """Refuse (:class:`DataError`) rows of ``source`` whose id the index holds and whose vector
    lies more than :data:`MODEL_INDEX_TOLERANCE` from the index's vector of that id: the same
    item embedded by another model or checkpoint, or another image under the same name (its
    neighbours would be searched in another space, ``--exclude-self`` would drop another
    image). Up to the first 4,096 shared ids are compared; ``fix`` ends the message."""
    if ids is None or not len(index) or not len(ids):
        return
    ids = np.asarray(ids).astype(str)
    rows = np.flatnonzero(np.isin(ids, index.ids))[:_SHARED_CHECKED]
    if not rows.size:
        return
    change = relative_changes(vectors[rows], index.get(ids[rows]))
    far = np.flatnonzero(change > MODEL_INDEX_TOLERANCE)
    if far.size:
        i = int(far[0])
        raise DataError(f"{source}: {far.size} of its {rows.size} items with an indexed id lie more than "
                        f"{MODEL_INDEX_TOLERANCE:.0%} from the index's vector of that id (e.g. {str(ids[rows[i]])!r}, "
                        f"{change[i]:.1%} away): embedded by another model (or checkpoint) than the index, or "
                        f"of other images under the same names; {fix}")


def check_model_embeds_index(index: Any, embedder: Any, root: Path, items: int = 4,
                             max_pixels: int | None = None) -> None:
    """Refuse (:class:`ConfigError`) a model that embeds indexed images differently from the
    index's vectors: image queries would be searched in another model's space and answered with
    unrelated items, silently (the start-up check of the embedding size passes any model of the
    same size). Compares up to ``items`` indexed files found under the data root (of the first
    64 ids), decoded as the datasets decode them (:func:`dmlkit.data.decode_8bit`); a file
    larger than ``max_pixels`` (the service's upload limit, read from the header: it is not
    decoded) or unreadable (truncated, beyond PIL's decompression-bomb limit, refused as
    blank) is passed over. An index without such files there (ids that are not paths, another
    data root) is not checked, with a warning saying so: the check was skipped without a word."""
    from PIL import Image  # lazy: imaging loads when a model is served

    from dmlkit.data import decode_8bit  # lazy: as PIL

    checked = tried = too_large = unreadable = 0
    for pos in range(min(len(index), 64)):
        if checked == items:
            break
        tried += 1
        path = file_under_root(root, str(index.ids[pos]))
        if path is None or not path.is_file():
            continue
        try:
            with Image.open(path) as img:
                w, h = img.size
                if max_pixels is not None and w * h > max_pixels:
                    too_large += 1
                    continue
                got = embedder([decode_8bit(img, path)])[:1]
        # not an image the model takes (a decompression bomb raised a traceback at start-up)
        except (OSError, ValueError, Image.DecompressionBombError, DmlkitError):
            unreadable += 1
            continue
        change = float(relative_changes(got, index.embeddings[pos:pos + 1])[0])
        if change > MODEL_INDEX_TOLERANCE:
            raise ConfigError(f"the model embeds the indexed image {index.ids[pos]} {change:.1%} away from the index's "
                              "vector: the index was built with another model (or checkpoint); serve the model the "
                              "index was built with, or rebuild the index with `dmlkit embed` + `dmlkit index`")
        checked += 1
    if tried and not checked:
        passed = [f"{n} {what}" for n, what in ((too_large, f"larger than {max_pixels} pixels"),
                                                (unreadable, "unreadable")) if n]
        why = f" ({', '.join(passed)})" if passed else ""
        warnings.warn(f"serve: the model was not checked against the index: none of its first {tried} ids is a "
                      f"readable image file under the data root {root}{why}; image queries are searched in the "
                      "index's space whatever model is served (pass --data-root with the folder the index was "
                      "built from)", stacklevel=3)


def verification_source(embeddings: str | os.PathLike | None = None,
                        checkpoint: str | os.PathLike | None = None) -> dict[str, Any]:
    """What ``dmlkit verify --json`` records of what its threshold was chosen on (``source``):
    the embeddings file (path and SHA-256) or the checkpoint (path and SHA-256), and the run
    they belong to (:func:`~dmlkit.apps.index_files.run_facts`), so ``dmlkit serve
    --verification`` can refuse a threshold of another model (:func:`check_threshold_source`)."""
    if embeddings is not None:
        path = Path(embeddings).resolve()
        return {"embeddings": str(path), "sha256": sha256_file(path), **run_facts(path.parent.parent)}
    file = find_checkpoint(Path(checkpoint)).resolve()  # type: ignore[arg-type]
    return {"checkpoint": str(file), "checkpoint_sha256": sha256_file(file), **run_facts(run_dir_of(file))}


def check_threshold_source(path: str | os.PathLike, source: Any, info: Mapping[str, Any]) -> None:
    """Refuse (:class:`DataError`) a verification file whose threshold was chosen on another
    run's embeddings than the index holds (``source``: its record, :func:`verification_source`;
    ``info``: the index's): a threshold is a score in one model's space, and another model's
    scores were judged by it without a word. The same embeddings file as the index's (by
    digest) passes; a file without the record (an older dmlkit), or another file where the
    source or the index names no run, or runs that cannot be told apart (:func:`_same_run`: an
    older index of a moved run), cannot be checked: a warning says so. Runs are compared, not
    checkpoints."""
    if not isinstance(source, Mapping):
        warnings.warn(f"{path} does not record which embeddings its threshold was chosen on (written by an older "
                      "dmlkit), so it is not checked against the index; write it again with `dmlkit verify ... "
                      "--json > FILE`", stacklevel=3)
        return
    if source.get("sha256") and source.get("sha256") == info.get("source_sha256"):
        return
    if "run_dir" not in source or "run_dir" not in info:
        warnings.warn(f"{path}: its threshold was chosen on {source.get('embeddings') or source.get('checkpoint')}, "
                      "which is not the index's embeddings file and names no run to compare with the index's: "
                      "it is not checked against the index", stacklevel=3)
        return
    if _same_run(info, source) is None:
        warnings.warn(f"{path}: its threshold was chosen on embeddings of the run {source['run_dir']}, and the "
                      f"index's run {info['run_dir']} records no identity to compare it with (an index of an older "
                      "dmlkit, its run since moved): it is not checked against the index; rebuild the index with "
                      "`dmlkit index` to have it checked", stacklevel=3)
        return
    differ = source_differences(info, source)  # the run: a source records no data root
    if differ:
        raise DataError(f"{path}: its threshold was chosen on embeddings of {differ[0]} (the index's): "
                        "a threshold is a score in one model's space; calibrate it on the index's run with "
                        "`dmlkit verify ... --json > FILE`, or pass --threshold T to use a number anyway")
