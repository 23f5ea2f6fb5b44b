"""The plumbing of ``dmlkit serve`` below the endpoints: request metrics, body limits, security
headers and the bounded pool that decodes and embeds uploaded images off the event loop.

Pure ASGI (no FastAPI import here): :class:`Record`, :class:`BodyLimit` and
:class:`SecurityHeaders` wrap the app's ``receive``/``send``; :class:`ImageWork` runs blocking
image work in threads of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

#: Slack of a JSON query body over its numbers: the braces, keys, ``k``, an id of up to 4,096
#: characters written as ``\\uXXXX`` escapes (6 bytes each, 24 KiB) and whitespace.
JSON_BODY_SLACK = 64 * 2**10
#: Bytes allowed per embedding value in a JSON query: ``repr`` of a float64 is at most 24
#: characters (``-1.2345678901234567e-308``), plus a separator and indentation.
JSON_BYTES_PER_VALUE = 64


def json_body_limit(dim: int, max_upload_bytes: int) -> int:
    """The largest body of ``/api/query/embedding`` and ``/api/query/id``: one query vector,
    ``JSON_BODY_SLACK + JSON_BYTES_PER_VALUE * dim`` bytes (64 KiB + 1 KiB for a 16-d index),
    and never more than ``max_upload_bytes``. The whole body is parsed by ``json.loads`` on the
    event loop before any field is checked: at the upload limit (8 MiB) one bad body held the
    loop for 1.3 s and 8 concurrent ones delayed a good query 8.6 s (audit s41 F2)."""
    return min(int(max_upload_bytes), JSON_BODY_SLACK + JSON_BYTES_PER_VALUE * max(int(dim), 1))


#: The Content-Security-Policy of every response (only a page, ``/``, has anything to restrict):
#: nothing by default; scripts only from the service itself (``/static/app.js``; no inline or
#: eval'd script, so text that slipped into the page as markup could not run); the page's own
#: ``<style>`` block and one ``style`` attribute (CSS only: no script); images from the
#: service (thumbnails), ``blob:`` (the previews of picked files) and ``data:`` (the empty
#: favicon); ``fetch`` to the service only; no ``<base>``, no form posting elsewhere, no framing
#: by another site (clickjacking). CSP Level 3, https://www.w3.org/TR/CSP3/.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' blob: data:; connect-src 'self'; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")
#: Headers :class:`SecurityHeaders` adds to every response: ``nosniff`` stops a browser from
#: running a response as another type than it is sent as (a thumbnail or JSON guessed to be
#: HTML or script); the referrer of the page's requests is not sent to anyone.
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"referrer-policy", b"no-referrer"),
)


class SecurityHeaders:
    """ASGI middleware: :data:`SECURITY_HEADERS` on every response (an endpoint's own value of
    one of them is kept). Outermost, so the 400s of the host check and the 413s of
    :class:`BodyLimit` carry them too."""

    def __init__(self, app: Any, headers: tuple[tuple[bytes, bytes], ...] = SECURITY_HEADERS) -> None:
        self.app, self.headers = app, tuple(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                given = list(message.get("headers") or [])
                names = {bytes(name).lower() for name, _ in given}
                message = {**message, "headers": given + [h for h in self.headers if h[0] not in names]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class Metrics:
    """Thread-safe request counters and a latency window per route; ``disconnected`` counts
    requests whose client hung up before any response (not in the status classes)."""

    def __init__(self, window: int = 1000) -> None:
        self.started = time.time()
        self.lock = threading.Lock()
        self.counts: dict[str, int] = defaultdict(int)
        self.status: dict[str, int] = defaultdict(int)
        self.latency: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self.disconnected = 0

    def record(self, route: str, status: int, seconds: float) -> None:
        with self.lock:
            self.counts[route] += 1
            self.status[f"{status // 100}xx"] += 1
            self.latency[route].append(seconds * 1000)

    def record_disconnect(self) -> None:
        with self.lock:
            self.disconnected += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            lat = {r: {"count": len(v), "p50_ms": float(np.percentile(list(v), 50)),
                       "p99_ms": float(np.percentile(list(v), 99))} for r, v in self.latency.items() if v}
            return {"uptime_s": time.time() - self.started, "requests": dict(self.counts),
                    "status": dict(self.status), "latency": lat, "disconnected": self.disconnected}


class Record:
    """ASGI middleware: each request's route template, status and latency into :class:`Metrics`.

    Pure ASGI, wrapping ``send`` to see the status: Starlette's ``BaseHTTPMiddleware`` raised
    ``RuntimeError: No response returned`` (a traceback in the server's log) when the app
    answered nothing, as for a client that hangs up mid-body (audit s41 F3); such a request is
    counted as ``disconnected``. An exception the app raises counts as a 500 and goes on up
    (Starlette's error middleware answers and logs it)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), None

        async def send_and_see(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        except Exception:  # not a cancellation: that is a client gone (no response)
            status = 500 if status is None else status
            raise
        finally:
            route = getattr(scope.get("route"), "path", "other")
            if status is None:
                self.metrics.record_disconnect()
            else:
                self.metrics.record(route, status, time.perf_counter() - t0)


class BodyLimit:
    """ASGI middleware: buffer request bodies up to ``max_bytes`` (``path_limits``: smaller
    limits of given paths, with what to send instead); answer 413 beyond, without reading on.
    A client that hangs up mid-body gets no response (there is no one to send it to)."""

    def __init__(self, app: Any, max_bytes: int, path_limits: Mapping[str, tuple[int, str]] | None = None) -> None:
        self.app, self.max_bytes, self.path_limits = app, max_bytes, dict(path_limits or {})

    def _limit(self, scope: Any) -> tuple[int, str]:
        return self.path_limits.get(scope.get("path", ""), (
            self.max_bytes, "send a smaller image (or start the server with a larger --max-upload-mb)"))

    @staticmethod
    async def _reject(send: Any, size: str, limit: int, fix: str) -> None:
        body = json.dumps({"detail": f"request body {size} exceeds the limit of {limit} bytes: {fix}"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, fix = self._limit(scope)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > limit:
                await self._reject(send, f"of {declared} bytes", limit, fix)
                return
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: nothing to answer (Record counts it as disconnected)
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                await self._reject(send, f"of more than {limit} bytes", limit, fix)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, sent = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def default_image_workers() -> int:
    """Image requests decoded and embedded at once by default: the CPU count, at most 4 (a
    40-megapixel upload decodes to about 120 MB of RGB, and the model's forward uses several
    cores of its own)."""
    return max(1, min(4, os.cpu_count() or 1))


class ServiceBusy(Exception):
    """Every image worker is busy and the waiting line is full: the service answers 503."""


class ImageWork:
    """Blocking image work (decode + embed + search) off the event loop, bounded.

    At most ``workers`` jobs run at once, in threads of this pool (not the threadpool that runs
    the service's plain ``def`` endpoints, which keeps answering health and JSON queries); up
    to ``queue`` more wait their turn, holding no thread; a request beyond that gets
    :class:`ServiceBusy` at once. Before, the image endpoints decoded and embedded inside the
    event loop: six 40-megapixel uploads ran one after the other and ``/api/health`` took 11.9 s
    instead of 78 ms (audit s41 F1). ``pending`` counts the jobs running or waiting.

    The served model is thus called from up to ``workers`` threads at once: a run's torch model
    (eval mode, its forward under ``torch.no_grad``, which is per thread), a TorchScript module
    and an onnxruntime session all take concurrent calls; the embedder's one cache (its
    smallest input side) is found the same by whichever thread computes it."""

    def __init__(self, workers: int, queue: int) -> None:
        self.workers, self.queue = int(workers), int(queue)
        self.pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="dmlkit-image")
        self.lock = threading.Lock()
        self.pending = 0

    def _done(self, _: Future[Any]) -> None:
        with self.lock:
            self.pending -= 1

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, awaited without blocking the loop; :class:`ServiceBusy`
        when ``workers + queue`` jobs are already running or waiting."""
        with self.lock:
            if self.pending >= self.workers + self.queue:
                raise ServiceBusy(f"the service is busy with {self.pending} image requests "
                                  f"({self.workers} at a time, {self.queue} waiting): try again in a moment")
            self.pending += 1
        try:
            future = self.pool.submit(fn, *args)
        except BaseException:
            with self.lock:
                self.pending -= 1
            raise
        future.add_done_callback(self._done)  # the job's end, even if its client left first
        return await asyncio.wrap_future(future)
