"""dmlkit's matplotlib settings: the one home of every rcParam dmlkit's figures use.

:func:`figure_style` applies :data:`RC` while a figure is built and saved
(``matplotlib.rc_context``), and :func:`styled` wraps a figure function in it. The settings hold
only there: importing dmlkit changes no global matplotlib state of the program that imports it
(an ``rcParams.update`` at import switched every later figure of that program to dmlkit's style,
math parsing included).

``text.parse_math`` is off: the names a figure draws are user text (class folder names, file
names, run folder names, method names), and matplotlib parsed a pair of ``$`` in them as
mathtext: ``price $5 or $6`` was drawn as "price 5*or*6" in italics, ``$\\alpha$`` as "α", and
an invalid expression such as ``bad $\\frac$ x`` raised ``ValueError: ParseSyntaxException``
when the figure was drawn. No dmlkit figure uses mathtext on purpose (no log axes either, whose
tick labels are mathtext).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["RC", "figure_style", "styled"]

#: The rcParams of every dmlkit figure (print quality: 200 dpi files; names drawn literally).
RC: dict[str, Any] = {
    "figure.dpi": 110,
    "savefig.dpi": 200,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.fontsize": 8,
    "text.parse_math": False,
}

_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def figure_style() -> Iterator[None]:
    """dmlkit's :data:`RC` for the figures built (and saved) inside the ``with`` block; the
    caller's rcParams are restored after it. A text object keeps the ``text.parse_math`` it was
    created with, so a figure built here draws its names literally wherever it is saved."""
    import matplotlib  # the caller chose the backend; matplotlib is imported only to draw

    with matplotlib.rc_context(RC):
        yield


def styled(function: _F) -> _F:
    """``function`` (one that builds or saves a figure) run inside :func:`figure_style`."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with figure_style():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
