"""Provenance: what is needed to reproduce a number (time, seed, package versions, dmlkit's git
commit, machine, command line), written beside every run, bench and build as ``provenance.json``."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from dmlkit.exceptions import CheckpointError
from dmlkit.utils import atomic_write_json, os_error_message

__all__ = ["provenance", "write_provenance"]

_PACKAGES = ("dmlkit", "torch", "torchvision", "numpy", "scikit-learn", "faiss-cpu", "optuna")


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str] | None:
    """``git *args`` in ``cwd``; None when git is missing or hangs."""
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None


def _is_dmlkit_source_tree(top: Path, package_dir: Path) -> bool:
    """True when the git work tree ``top`` is dmlkit's own source: its ``pyproject.toml`` names
    project ``dmlkit`` and its ``src/dmlkit`` is the imported package's directory."""
    try:
        with (top / "pyproject.toml").open("rb") as fh:
            name = tomllib.load(fh).get("project", {}).get("name")
        return name == "dmlkit" and (top / "src" / "dmlkit").resolve() == package_dir.resolve()
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return False


def _git_commit(package_dir: Path | None = None) -> str | None:
    """dmlkit's own git commit (``-dirty`` when tracked files differ), or None.

    Only a source checkout (an editable install, or ``PYTHONPATH=src``) has one. An installed
    copy in ``site-packages`` has none: git would otherwise walk up to whatever repository holds
    the virtual environment (a user's project with ``.venv/`` inside it) and report *its* HEAD.
    There ``versions["dmlkit"]`` identifies the release.
    """
    here = (package_dir or Path(__file__).parent).resolve()
    top = _git(["rev-parse", "--show-toplevel"], here)
    if top is None or top.returncode != 0 or not top.stdout.strip():
        return None
    if not _is_dmlkit_source_tree(Path(top.stdout.strip()), here):
        return None
    out = _git(["rev-parse", "HEAD"], here)
    dirty = _git(["status", "--porcelain", "--untracked-files=no"], here)
    if out is None or out.returncode != 0 or dirty is None:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance(seed: int | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What is needed to reproduce a number: time, seed, versions, git commit, machine.

    ``git_commit`` is dmlkit's own commit from a source checkout, else None
    (:func:`_git_commit`)."""
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info: dict[str, Any] = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "seed": seed,
        "versions": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_commit": _git_commit(),
        "argv": sys.argv,
    }
    if extra:
        info.update(extra)
    return info


def write_provenance(path: str | os.PathLike, seed: int | None = None,
                     extra: Mapping[str, Any] | None = None) -> Path:
    """Write :func:`provenance` to ``path`` atomically; a failed write (disk full, no
    permission) is one :class:`~dmlkit.exceptions.CheckpointError` line, as for checkpoints."""
    try:
        return atomic_write_json(path, provenance(seed, extra=extra))
    except OSError as exc:
        raise CheckpointError(os_error_message(exc, path, writing=True)) from exc
