"""dmlkit's matplotlib settings: the one home of every rcParam dmlkit's figures use.

:func:`figure_style` applies :data:`RC` while a figure is built and saved
(``matplotlib.rc_context``), and :func:`styled` wraps a figure function in it. The settings hold
only there: importing dmlkit changes no global matplotlib state of the program that imports it
(an ``rcParams.update`` at import switched every later figure of that program to dmlkit's style,
math parsing included), and neither do figures drawn from several threads at once (one
:func:`figure_style` block at a time).

``text.parse_math`` is off: the names a figure draws are user text (class folder names, file
names, run folder names, method names), and matplotlib parsed a pair of ``$`` in them as
mathtext: ``price $5 or $6`` was drawn as "price 5*or*6" in italics, ``$\\alpha$`` as "α", and
an invalid expression such as ``bad $\\frac$ x`` raised ``ValueError: ParseSyntaxException``
when the figure was drawn. No dmlkit figure uses mathtext on purpose (no log axes either, whose
tick labels are mathtext).

matplotlib warns "Glyph 26085 (...) missing from font(s) DejaVu Sans." for each character its
font lacks, in every figure drawn (a report of class folders named in Chinese or Japanese gave
the same warnings 12 times): inside :func:`figure_style` they are gathered into one
``warning:`` line per process naming the characters (:func:`_one_glyph_warning`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dmlkit.utils import PROCESS_STATE_LOCK

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
#: matplotlib's warning for a character its font cannot draw (``matplotlib._text_helpers``).
_MISSING_GLYPH = re.compile(r"Glyph (\d+) .*missing from font")
#: The characters this process has already warned about.
_missing_said: set[str] = set()
#: The registry of the warnings re-emitted after a figure (``warn_explicit``'s once-a-place).
_reemitted: dict[Any, Any] = {}


@contextlib.contextmanager
def _one_glyph_warning() -> Iterator[None]:
    """matplotlib's "Glyph N missing from font(s)" warnings of the block as one warning naming
    the characters not named before in this process; every other warning as it came."""
    held: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message=_MISSING_GLYPH.pattern, category=UserWarning)
            try:
                yield
            finally:
                held = list(caught)
    finally:  # also when the figure failed: its warnings may say why
        _reemit(held)


def _reemit(held: list[warnings.WarningMessage]) -> None:
    """The held warnings as they came (shown once a place, as the default filter would), the
    missing glyphs as one."""
    missing: list[str] = []
    for w in held:
        match = _MISSING_GLYPH.match(str(w.message))
        if match is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source,
                                   registry=_reemitted)
        elif (char := chr(int(match.group(1)))) not in _missing_said and char not in missing:
            missing.append(char)
    if missing:
        _missing_said.update(missing)
        warnings.warn(f"the figures' font has no glyph for {' '.join(missing)}: those characters are drawn "
                      "as empty boxes (install a font that has them, e.g. Noto Sans CJK, and name it "
                      "in matplotlib's font.sans-serif)", UserWarning, stacklevel=4)


@contextlib.contextmanager
def figure_style() -> Iterator[None]:
    """dmlkit's :data:`RC` for the figures built (and saved) inside the ``with`` block; the
    caller's rcParams are restored after it; missing glyphs are one warning (module docstring). A text object keeps the ``text.parse_math`` it was
    created with, so a figure built here draws its names literally wherever it is saved.

    One block at a time in the process (:data:`dmlkit.utils.PROCESS_STATE_LOCK`, re-entrant, so
    a figure function may call another): ``rc_context`` and ``catch_warnings`` save and restore
    process-wide state, and figures drawn at once from several threads left dmlkit's RC in the
    caller's rcParams and the warnings' display pointing at a finished figure's list (every
    later warning of the process dropped)."""
    import matplotlib  # the caller chose the backend; matplotlib is imported only to draw

    with PROCESS_STATE_LOCK, _one_glyph_warning(), matplotlib.rc_context(RC):
        yield


def styled(function: _F) -> _F:
    """``function`` (one that builds or saves a figure) run inside :func:`figure_style`."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with figure_style():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
