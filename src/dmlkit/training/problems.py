"""The problems a preflight finds: one violated constraint each (:class:`Problem`, with a value
that fits in ``--set`` spelling), and the error and warning classes that report them. Shared by
:mod:`dmlkit.training.preflight` and :mod:`dmlkit.protocol.preflight`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dmlkit.exceptions import ConfigError

__all__ = ["NO_FIT", "PreflightError", "PreflightWarning", "Problem", "Severity", "format_value"]

Severity = Literal["error", "warning"]
#: ``Problem.fit`` when no single value of the key fits (``None`` is a value: ``--set k=null``).
NO_FIT = object()


class PreflightError(ConfigError):
    """A config does not fit its data; ``problems`` lists every violation (with fitting values)."""

    def __init__(self, message: str, problems: Sequence[Problem] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


class PreflightWarning(UserWarning):
    """The run is meaningful but weaker than the config suggests (e.g. singleton classes)."""


def format_value(value: Any) -> str:
    """``value`` as ``--set`` parses it back (YAML): ``true``, ``0.4``, ``[4, 2, 4]``, ``auto``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"  # no space: one shell word
    return str(value)


@dataclass(frozen=True)
class Problem:
    """One violated constraint: the config ``key`` (CLI spelling), what is wrong, and a value
    of that key that fits (``fit``; absent when no single value does, then ``hint`` says what to do)."""

    key: str
    message: str
    fit: Any = NO_FIT
    severity: Severity = "error"
    hint: str | None = None

    @property
    def has_fit(self) -> bool:
        return self.fit is not NO_FIT

    @property
    def fix(self) -> str | None:
        """``--set key=value`` with the fitting value, or ``None``."""
        return f"--set {self.key}={format_value(self.fit)}" if self.has_fit else None

    def line(self) -> str:
        todo = self.fix or self.hint
        return f"{self.key}: {self.message}" + (f": {todo}" if todo else "")
