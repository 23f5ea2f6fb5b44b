"""What ``dmlkit serve`` serves (:class:`ServiceConfig`) and the facts the app reads from
files at start (the verification threshold) or shows of them (the index's ``info``)."""

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError
from dmlkit.utils import read_json
from dmlkit.validation import check_integer


def _host_pattern(name: str) -> bool:
    """Whether ``name`` is a ``Host`` pattern starlette's ``TrustedHostMiddleware`` can match (it
    checks them only at the first request: ``*foo`` failed every request with a 500): ``*``,
    ``*.domain``, a bracketed IPv6 address or a name without ``*``, ``:`` (a port never matches:
    the header's port is stripped first), ``/`` or blanks."""
    if name == "*":
        return True
    body = name[2:] if name.startswith("*.") else name
    if body.startswith("[") and body.endswith("]"):
        return body is name and len(body) > 2 and all(c in "0123456789abcdefABCDEF:." for c in body[1:-1])
    return bool(body) and not any(c in body for c in "*:/ \t") and body == body.strip()


#: The ``Host`` names of a loopback server (``allowed_hosts``' default in ``run_server``).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


@dataclass
class ServiceConfig:
    """What ``dmlkit serve`` serves.

    Args:
        index: an index directory/file from ``dmlkit index``.
        model: run directory or exported model for image queries (``None``: embedding and id
            queries only).
        threshold: verification threshold on the score (``same`` when ``score >= threshold``),
            the score of the index's own distance (``cosine``; ``euclidean``/``dot`` on the
            normalised rows, or ``raw-euclidean``/``raw-dot`` for an index built without
            normalisation: ``dmlkit verify --distance`` of the same name gives such thresholds).
        verification: JSON of ``dmlkit verify --json`` (its ``threshold`` and the ``distance`` it
            was chosen on, which scores the pairs; a file without the distance is refused).
        data_root: where relative item ids (dataset paths) are found for thumbnails (default:
            the ``data_root`` recorded in the index).
        max_upload_bytes: largest request body; larger ones get 413. The JSON queries
            (``/api/query/embedding``, ``/api/query/id``) take at most 64 KiB + 64 bytes per
            dimension of the index (and never more than this):
            :func:`~dmlkit.apps.service.middleware.json_body_limit`.
        max_k: largest ``k`` a request may ask for.
        max_image_pixels: decoded images larger than this get 413 (decompression bombs).
        image_workers: image requests (``/api/query/image``, ``/api/verify``) decoded and
            embedded at once, in threads off the event loop (``None``: the CPU count, at most 4).
        image_queue: image requests that may wait for a worker (``None``: 4 per worker); one
            beyond gets 503 with ``Retry-After: 1`` at once
            (:class:`~dmlkit.apps.service.middleware.ImageWork`).
        allowed_hosts: the names a request's ``Host`` header may give (any port); another gets
            400. A loopback server is otherwise open to DNS rebinding: a page of another site
            whose name it re-points at 127.0.0.1 reads the service through the visitor's
            browser. ``None``: any host, except that :func:`~dmlkit.apps.service.app.run_server`
            on a loopback address answers :data:`LOOPBACK_HOSTS` only; ``"*"`` allows any.
    """

    index: Path | str
    model: Path | str | None = None
    threshold: float | None = None
    verification: Path | str | None = None
    data_root: Path | str | None = None
    max_upload_bytes: int = 8 * 2**20
    max_k: int = 100
    max_image_pixels: int = 40_000_000
    device: str = "cpu"
    thumbnail_size: int = 160
    image_workers: int | None = None
    image_queue: int | None = None
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        """Refuse limits no request could meet (``max_k`` 0 served a 422 to every query)."""
        for name in ("max_upload_bytes", "max_k", "max_image_pixels", "thumbnail_size"):
            check_integer(getattr(self, name), name)
        if self.image_workers is not None:
            check_integer(self.image_workers, "image_workers")
        if self.image_queue is not None:
            check_integer(self.image_queue, "image_queue", least=0)
        if self.allowed_hosts is not None:
            hosts = (self.allowed_hosts,) if isinstance(self.allowed_hosts, str) else tuple(self.allowed_hosts)
            if not hosts or not all(isinstance(h, str) and _host_pattern(h) for h in hosts):
                raise ConfigError(f"allowed_hosts must be host names without a port ('proxy.lan', "
                                  f"'[::1]'), '*.domain' or '*', got {self.allowed_hosts!r}")
            self.allowed_hosts = tuple(h.lower() for h in hosts)


def index_verify_distance(idx: Any) -> str:
    """The :data:`~dmlkit.apps.verification.VERIFY_DISTANCES` name that scores pairs as the
    index compares them, for ``--threshold`` given alone: an index of raw (unnormalised)
    ``euclidean``/``dot`` embeddings is ``raw-euclidean``/``raw-dot`` (its bare name would score
    the pair on normalised rows, another scale than the one the threshold was chosen on)."""
    if idx.distance != "cosine" and not idx.normalize:
        return f"raw-{idx.distance}"
    return str(idx.distance)


def load_threshold(config: ServiceConfig, info: dict[str, Any]) -> tuple[float | None, str | None]:
    """``(threshold, its distance)`` of ``--threshold`` or ``--verification`` (``None``s without);
    a verification file must name its distance, and its recorded source (``dmlkit verify
    --json``'s ``source``) must be the index's run
    (:func:`dmlkit.apps.index_sources.check_threshold_source`)."""
    if config.threshold is not None and config.verification is not None:
        raise ConfigError("pass --threshold or --verification, not both")
    if config.threshold is not None:
        if not math.isfinite(config.threshold):
            raise ConfigError(f"the threshold must be a finite number, got {config.threshold}")
        return float(config.threshold), None
    if config.verification is None:
        return None, None
    path = Path(config.verification)
    if not path.is_file():
        raise DataNotFoundError(f"verification file not found: {path} (write it with `dmlkit verify ... --json > FILE`)")
    data = read_json(path, "verification file")  # corrupt, non-UTF-8 or nested ~100,000 deep: one DataError line
    try:
        threshold = float(data["threshold"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path} holds no 'threshold': write it with `dmlkit verify ... --json > FILE`") from exc
    distance = data.get("distance")
    if not isinstance(distance, str) or not math.isfinite(threshold):
        # a threshold is a score on one distance: another one's scores would be judged by it
        raise DataError(f"{path} does not say which distance its threshold {threshold} is on: write it again with "
                        "`dmlkit verify ... --json > FILE` (it records the distance), or pass --threshold")
    from dmlkit.apps.index_sources import check_threshold_source  # lazy: as the index

    check_threshold_source(path, data.get("source"), info)
    return threshold, distance


#: ``info`` keys of an index that name the server's folders: not sent by ``/api/info``.
_PRIVATE_INFO = ("run_dir", "data_root")


def public_info(info: Any) -> Any:
    """An index's ``info`` as ``/api/info`` sends it: without the server's folders (``run_dir``,
    ``data_root``) and with any other path (``source``) reduced to its file name; they told
    every client where the run and the data lie (audit s41 F5). The run's digest (``run``),
    the dataset and ``source_sha256`` stay: they say which model and data, not where."""
    if not isinstance(info, dict):
        return info
    out = {}
    for key, value in info.items():
        if key in _PRIVATE_INFO:
            continue
        if isinstance(value, str) and (key == "source" or os.path.isabs(value)):
            value = Path(value).name
        out[key] = value
    return out
