"""Which dmlkit scored a value that is kept and compared later.

A search trial's objective (validation MAP@R) and a training run's best validation MAP@R are
stored, and a resumed search or run compares new values with them. When the metric code
changes, the same embeddings can score differently in the last digits, and a near tie between
an old and a new value is then decided by the change, not by the models. Such values are
recorded with :func:`scoring_stamp`; :func:`scored_elsewhere` says, on resume, when they came
from another dmlkit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dmlkit import __version__

__all__ = ["SCORING_REVISION", "scored_elsewhere", "scoring_stamp", "this_scorer"]

#: Bump when a metric's values change (the same embeddings score differently, even in the
#: last digits): values scored before and after are then told apart on resume. The package
#: version alone does not change between such commits.
SCORING_REVISION = 1


def scoring_stamp() -> dict[str, Any]:
    """What scores values now: ``{"dmlkit": __version__, "scoring_revision": SCORING_REVISION}``."""
    return {"dmlkit": __version__, "scoring_revision": SCORING_REVISION}


def _described(stamp: Mapping[str, Any]) -> str:
    return f"dmlkit {stamp.get('dmlkit', '?')}, scoring revision {stamp.get('scoring_revision', '?')}"


def scored_elsewhere(recorded: Any) -> str | None:
    """``None`` where ``recorded`` is this dmlkit's :func:`scoring_stamp`; else the dmlkit that
    scored the value, in words (one that recorded nothing is an older dmlkit)."""
    if recorded == scoring_stamp():
        return None
    if not isinstance(recorded, Mapping):
        return "an older dmlkit, which did not record its version"
    return _described(recorded)


def this_scorer() -> str:
    """This dmlkit, in the words of :func:`scored_elsewhere`."""
    return _described(scoring_stamp())
