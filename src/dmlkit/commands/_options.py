"""Shared parsing of command-line option values."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer

__all__ = ["given", "listed"]


def listed(values: Iterable[str]) -> list[str]:
    """The values of a repeatable option each of whose uses may also list several values,
    comma-separated: ``-m map,map_at_r -m nmi`` gives ``["map", "map_at_r", "nmi"]`` (stripped,
    empty items dropped, order kept). A second use adds to the first instead of replacing it."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the option of parameter ``name`` was given on the command line (or by environment),
    not defaulted: an option the chosen path does not use is refused only when it was given."""
    source = ctx.get_parameter_source(name)  # typer bundles its own click: compare the source by name
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")
