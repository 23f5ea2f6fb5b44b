"""Class labels written as text, one label a line (a labels file) or a column (a dataset CSV):
the one rule both readers follow on the whitespace around a label and on which labels are
integer class ids and which class names. Imports nothing but the error classes, so a small
``dmlkit evaluate`` that reads a labels file stays small."""

from __future__ import annotations

from collections.abc import Sequence

from dmlkit.exceptions import DataError

__all__ = ["clean_labels", "integer_ids", "refuse_nul"]


def refuse_nul(label: str, where: str) -> None:
    """Refuse a label holding a NUL character: numpy's string arrays drop trailing NULs, so
    ``"a\\x00"`` and ``"a"`` became one class once stored; no class name needs one."""
    if "\x00" in label:
        raise DataError(f"{where}: the label {label!r} holds a NUL character (\\x00), which numpy's "
                        "string arrays drop, so it would merge with another class; remove it")


def clean_labels(raw: Sequence[str], source: str, lines: Sequence[int] | None = None) -> list[str]:
    """``raw`` without the whitespace around each label (a CSV's ``a, cat``, an editor's
    trailing space), which is not part of a class name. Two labels that differ only in that
    whitespace (``cat`` and ``cat ``) would silently become one class, so they are refused, as
    is a NUL character; ``lines`` (each label's line in ``source``, default its position + 1)
    name where. Blank labels stay blank (``""``): whether one is allowed is the caller's rule."""
    lines = lines if lines is not None else range(1, len(raw) + 1)
    first: dict[str, tuple[str, int]] = {}
    out = []
    for label, line in zip(raw, lines, strict=True):
        refuse_nul(label, f"{source}: line {line}")
        name = label.strip()
        seen, seen_line = first.setdefault(name, (label, line))
        if name and seen != label:
            raise DataError(f"{source}: the labels {seen!r} (line {seen_line}) and {label!r} (line {line}) "
                            "differ only in the whitespace around them, which is not part of a class "
                            "name, so they would be one class; write them alike, or give the two "
                            "classes names that differ in more than spaces")
        out.append(name)
    return out


def integer_ids(labels: Sequence[str], numbers: Sequence[int | None]) -> list[int] | None:
    """``numbers`` (each label read as an integer by its reader's number format; ``None``
    where it is not one) as class ids when every label is an integer and no two different
    labels read as one integer; else ``None``: the labels are class names. ``1``, ``01`` and
    ``+1`` are three classes, kept apart as names, never merged into class 1."""
    if not labels or any(n is None for n in numbers):
        return None
    if len(set(numbers)) < len(set(labels)):
        return None
    return [int(n) for n in numbers if n is not None]
