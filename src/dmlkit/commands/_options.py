"""Shared parsing of command-line option values."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["listed"]


def listed(values: Iterable[str]) -> list[str]:
    """The values of a repeatable option each of whose uses may also list several values,
    comma-separated: ``-m map,map_at_r -m nmi`` gives ``["map", "map_at_r", "nmi"]`` (stripped,
    empty items dropped, order kept). A second use adds to the first instead of replacing it."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]
