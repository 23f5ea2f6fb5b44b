"""Run logs: ``log.jsonl`` (always), ``log.csv`` (optional) and TensorBoard (optional).

Every line of ``log.jsonl`` is one JSON object (see ``docs/architecture.md``)::

    {"event": "train", "epoch", "step", "loss", "lr", "time", ...}
    {"event": "eval", "epoch", "step", "split": "val", <metric keys>..., "time"}

``time`` is the training time in seconds since the run started (resumes included); ``wall``
is the Unix time at which the line was written.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import time
from pathlib import Path
from typing import Any

from dmlkit.exceptions import CheckpointError, require
from dmlkit.utils import atomic_write_text, open_appending, os_error_message

__all__ = ["RunLogger", "read_log"]

logger = logging.getLogger("dmlkit.training")


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a ``log.jsonl`` file. A line that is not a record (a torn last line from
    a kill, or a damaged one: not a JSON object with a string ``event``, or a ``step`` that is
    not a whole number) is skipped, with a warning naming it when other records remain."""
    path = Path(path)
    if not path.exists():
        return []
    records, skipped = [], []
    lines = path.read_text(encoding="utf-8").splitlines()
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: a line nested ~100,000 deep
            if number == last:  # torn by a kill mid-write: expected, silent
                continue
            record = None
        if (isinstance(record, dict) and isinstance(record.get("event"), str)
                and (type(record.get("step", 0)) is int)):
            records.append(record)
        else:
            skipped.append(number)
    if skipped and records:  # with no record left, the caller's own error says the file is unusable
        logger.warning("%s: skipped %d line(s) that are not log records (line %s)", path,
                       len(skipped), ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else ""))
    return records


class RunLogger:
    """Appends records to ``RUN_DIR/log.jsonl``; mirrors them to CSV and TensorBoard on request."""

    def __init__(self, run_dir: str | Path, *, csv_log: bool = False, tensorboard: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "log.jsonl"
        self.csv_log = csv_log
        self._writer = None
        if tensorboard:
            require("tensorboard", "tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._fh = None

    def truncate_after(self, step: int) -> None:
        """Drop records logged after ``step`` (work lost by a kill, redone on resume)."""
        kept = [r for r in read_log(self.path) if int(r.get("step", 0)) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (with ``wall``) to ``log.jsonl``. A ``log.jsonl`` that is a symbolic
        link to a file outside the run directory's folder is a :class:`DataError`
        (:func:`~dmlkit.utils.link_target_inside`), never appended to; the file is opened with
        ``O_NOFOLLOW``, so a link planted after that check is an error too."""
        record = {**record, "wall": round(time.time(), 3)}
        try:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open_appending(self.path, encoding="utf-8")
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
        except OSError as exc:  # disk full: one clear error, as for checkpoints
            self._drop_handle()
            raise CheckpointError(os_error_message(exc, self.path, writing=True)) from exc
        if self._writer is not None:
            prefix = record.get("split", record["event"])
            for key, value in record.items():
                if key in ("event", "epoch", "step", "split", "wall") or not isinstance(value, int | float):
                    continue
                self._writer.add_scalar(f"{prefix}/{key}", value, global_step=int(record.get("step", 0)))

    def flush(self) -> None:
        """Write ``log.csv`` (when enabled) from ``log.jsonl``; called at every checkpoint."""
        if self._fh is not None:
            try:
                self._fh.flush()
            except OSError as exc:
                self._drop_handle()
                raise CheckpointError(os_error_message(exc, self.path, writing=True)) from exc
        if self._writer is not None:
            self._writer.flush()
        if self.csv_log:
            records = read_log(self.path)
            columns: list[str] = []
            for r in records:
                columns += [k for k in r if k not in columns]
            buffer = io.StringIO()
            writer = csv.DictWriter(buffer, fieldnames=columns)
            writer.writeheader()
            writer.writerows(records)
            try:
                atomic_write_text(self.run_dir / "log.csv", buffer.getvalue())
            except OSError as exc:
                raise CheckpointError(os_error_message(exc, self.run_dir / "log.csv", writing=True)) from exc

    def _drop_handle(self) -> None:
        """Close the log after a failed write; its unwritable buffer is dropped, not retried
        (a retry at close would raise the same error a second time)."""
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass

    def close(self) -> None:
        self.flush()
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
