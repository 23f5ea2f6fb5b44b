"""Seeing the embedding space: figures and a self-contained HTML report.

* :mod:`dmlkit.report.figures` - one pure function per figure (matplotlib, print quality).
* :func:`build_report` - ``report.html`` + ``figures/`` for a run or benchmark directory.
"""

from dmlkit.report.builder import ReportOptions, build_report

__all__ = ["ReportOptions", "build_report"]
