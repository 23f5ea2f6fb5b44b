"""The HTTP API and web page of ``dmlkit serve``.

(No ``from __future__ import annotations`` here: FastAPI reads the endpoint annotations, which
name models defined inside :func:`create_app`.)

Endpoints (JSON unless noted; the OpenAPI schema is at ``/openapi.json``; no interactive docs at
``/docs`` or ``/redoc``: FastAPI's load their scripts from a CDN, docs/search.md):

* ``GET /api/health``, ``GET /api/info``, ``GET /api/metrics`` (request counts, status
  classes, p50/p99 latency per route over the last 1000 requests, uptime);
* ``POST /api/query/embedding`` ``{"embedding": [...], "k": 10}``;
* ``POST /api/query/id`` ``{"id": "...", "k": 10, "exclude_self": true}``;
* ``POST /api/query/image`` (multipart ``file``, form ``k``): needs a model (``k``
  defaults to 10, or to ``max_k`` where that is smaller; the page reads ``max_k`` from
  ``/api/info``);
* ``POST /api/verify`` (multipart ``image1``, ``image2``): same/different against the
  calibrated threshold of ``dmlkit verify``;
  both decode and embed in image workers off the event loop, a bounded number at a time
  (:class:`~dmlkit.apps.service.middleware.ImageWork`: 503 when they and their queue are full);
* ``GET /api/items/{id}`` (label, metadata) and ``GET /api/items/{id}/thumbnail`` (PNG);
* ``GET /`` the web page (``static/index.html`` + ``static/app.js``).

Bad input gets a 4xx with ``{"detail": "<what to do>"}``: 400 not an image, 404 unknown id,
409 the service lacks a model or threshold, 413 body over the limit (the JSON queries': 64 KiB
+ 64 bytes per dimension) or image too large, 422 wrong embedding size, non-finite values, k
out of range or not written as an integer, a form with two parts of one name, or an image the
model cannot embed (checked before the model runs:
:meth:`dmlkit.apps.export.ImageEmbedder.check_input`); 503 every image worker busy and their
queue full (``Retry-After: 1``). A model that fails on an image it takes (out of memory, a
broken ONNX session) is a 500 whose cause is logged (``dmlkit.service``) and not sent.

Every response carries ``X-Content-Type-Options: nosniff``, a Content-Security-Policy that lets
the page load only its own script, styles, images and API
(:data:`~dmlkit.apps.service.middleware.CONTENT_SECURITY_POLICY`) and
``Referrer-Policy: no-referrer``.
"""


import dataclasses
import io
import ipaddress
import logging
import re
import sys
import threading
import time
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import numpy as np

from dmlkit.apps.service.config import (
    LOOPBACK_HOSTS,
    ServiceConfig,
    index_verify_distance,
    load_threshold,
    public_info,
)
from dmlkit.apps.service.middleware import (
    BodyLimit,
    ImageWork,
    Metrics,
    Record,
    SecurityHeaders,
    ServiceBusy,
    default_image_workers,
    json_body_limit,
)
from dmlkit.exceptions import ConfigError, DataError, DmlkitError, require

STATIC = Path(__file__).parent / "static"
logger = logging.getLogger("dmlkit.service")


def create_app(config: ServiceConfig, *, index: Any = None, embedder: Any = None) -> Any:
    """The FastAPI app serving ``config`` (``index``/``embedder`` objects override the paths)."""
    fastapi = require("fastapi", "serve")
    require("python_multipart", "serve")
    from fastapi import File, Form, HTTPException, Request, UploadFile
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response
    from pydantic import BaseModel, Field

    from dmlkit.apps.index import EmbeddingIndex  # lazy: faiss and numpy load when an app is built
    from dmlkit.apps.index_files import file_under_root  # lazy: as the index
    from dmlkit.apps.index_sources import check_model_embeds_index  # lazy: as the index
    from dmlkit.apps.verification import pair_scores  # lazy: torch loads when an app is built

    idx = index if index is not None else EmbeddingIndex.load(config.index, mmap=True)
    if embedder is None and config.model is not None:
        from dmlkit.apps.export import load_embedder  # lazy: torch/onnxruntime only with a model

        embedder = load_embedder(config.model, device=config.device)
    if embedder is not None and idx.dim:
        from dmlkit.apps.export import EmbedderFailure  # lazy: torch/onnxruntime only with a model

        try:
            probe_dim = embedder(_probe_image(embedder)).shape[1]
        except EmbedderFailure as exc:  # at start: a model that cannot serve, one line
            raise ConfigError(f"the model cannot embed a blank image at start-up: {exc}") from exc
        if probe_dim != idx.dim:
            raise ConfigError(f"the model gives {probe_dim}-d embeddings but the index "
                              f"holds {idx.dim}-d ones: serve the model the index was built with")
    threshold, verify_distance = load_threshold(config, idx.info)
    verify_distance = verify_distance or index_verify_distance(idx)
    root = config.data_root or idx.info.get("data_root")
    root_path = Path(root).resolve() if root else None
    if embedder is not None and idx.dim and root_path is not None:
        check_model_embeds_index(idx, embedder, root_path, max_pixels=config.max_image_pixels)
    metrics = Metrics()
    max_k = int(config.max_k)
    default_k = min(10, max_k)  # a request without k: 10 exceeded a max_k below 10 (every one a 422)
    workers = config.image_workers or default_image_workers()
    image_work = ImageWork(workers, 4 * workers if config.image_queue is None else config.image_queue)

    app = fastapi.FastAPI(
        title="dmlkit visual search",
        version="1",
        # no Swagger UI / ReDoc: FastAPI's pages load their script and CSS from cdn.jsdelivr.net
        # (a third party's code next to the service's API); /openapi.json stays
        docs_url=None,
        redoc_url=None,
        description="Nearest-neighbour search over a trained embedding: query by image, embedding or id; "
                    "verify two images against a calibrated threshold.",
    )

    # the body limit inside the recorder (the last middleware added is the outermost), so
    # /api/metrics counts the 413s it answers too; the JSON queries have a limit of their own
    # (one vector: an 8 MiB body of numbers held the event loop for 1.3 s in json.loads)
    json_limit = json_body_limit(idx.dim or 0, config.max_upload_bytes)
    json_fix = (f"a JSON query is one {idx.dim}-d embedding or one id (its limit: 64 KiB + 64 bytes per "
                "dimension; --max-upload-mb applies to image uploads)")
    app.add_middleware(BodyLimit, max_bytes=int(config.max_upload_bytes),
                       path_limits={p: (json_limit, json_fix) for p in ("/api/query/embedding", "/api/query/id")})
    app.add_middleware(Record, metrics=metrics)
    if config.allowed_hosts is not None:  # outside the app: a foreign Host gets 400 before anything runs
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(config.allowed_hosts))
    app.add_middleware(SecurityHeaders)  # outermost: the host check's 400s carry the headers too

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Any:
        # FastAPI's default echoes the input, which fails on NaN; give locations and messages only
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", ""))} for e in exc.errors()]
        summary = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors[:5])
        return JSONResponse(status_code=422, content={"detail": f"invalid request: {summary}", "errors": errors[:20]})

    @app.exception_handler(DmlkitError)
    async def _dmlkit_error(request: Request, exc: DmlkitError) -> Any:
        status = 404 if isinstance(exc, DataError) and "not in the index" in str(exc) else 422
        return JSONResponse(status_code=status, content={"detail": str(exc)})

    if embedder is not None:
        from dmlkit.apps.export import EmbedderFailure  # lazy: torch/onnxruntime only with a model

        @app.exception_handler(EmbedderFailure)
        async def _model_failure(request: Request, exc: EmbedderFailure) -> Any:
            # the model failed on images it takes (out of memory, a broken session): the
            # server's fault, logged with its cause; the client learns nothing internal
            logger.error("%s %s: %s", request.method, request.url.path, exc, exc_info=exc)
            return JSONResponse(status_code=500, content={
                "detail": "the model failed to embed the image (a server error, logged by the service): "
                          "try again later or tell the service's operator"})

    class Neighbour(BaseModel):
        rank: int
        id: str
        score: float
        label: int | str | None = None  # the class name when the index holds names
        metadata: dict[str, Any] | None = None
        thumbnail: str

    class SearchResponse(BaseModel):
        results: list[Neighbour]
        k: int
        took_ms: float

    # strict JSON types: true was k = 1, [true, false, ...] a vector of ones and zeros, "3" a k
    class EmbeddingQuery(BaseModel):
        embedding: list[Annotated[float, Field(allow_inf_nan=False, strict=True)]] = Field(
            ..., min_length=1, max_length=65536, description=f"a {idx.dim}-d query embedding")
        k: int = Field(default_k, ge=1, strict=True, description=f"neighbours to return (at most {max_k})")

    class IdQuery(BaseModel):
        id: str = Field(..., min_length=1, max_length=4096, description="an indexed item's id")
        k: int = Field(default_k, ge=1, strict=True, description=f"neighbours to return (at most {max_k})")
        exclude_self: bool = Field(True, strict=True, description="drop the item itself from its results")

    class VerifyResponse(BaseModel):
        same: bool
        score: float
        threshold: float
        distance: str

    def check_k(k: int) -> int:
        if k > max_k:
            raise HTTPException(422, f"k={k} is larger than this service's limit of {max_k}")
        return k

    def results(vectors: np.ndarray, k: int, exclude: str | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        if vectors.shape[1] != idx.dim:
            raise HTTPException(422, f"the embedding has {vectors.shape[1]} values; this index holds {idx.dim}-d embeddings")
        res = idx.search(vectors, k, exclude_ids=None if exclude is None else [exclude])
        rows = []
        for rec in res.to_records()[0]:
            rows.append({"rank": rec["rank"], "id": rec["id"], "score": rec["score"], "label": rec.get("label"),
                         "metadata": rec.get("metadata"),
                         "thumbnail": f"/api/items/{quote(rec['id'], safe='')}/thumbnail"})
        return {"results": rows, "k": k, "took_ms": (time.perf_counter() - t0) * 1000}

    def read_image(upload: UploadFile) -> Any:
        """The upload decoded as the datasets decode their files (:func:`dmlkit.data.decode_8bit`:
        16-bit colour at full depth, EXIF orientation, 16-bit/float scaled), its errors naming
        the upload's file name (they said ``image #0``). Blocking: called in an image worker
        (:class:`~dmlkit.apps.service.middleware.ImageWork`), never on the event loop."""
        from PIL import Image, UnidentifiedImageError

        from dmlkit.data import decode_8bit  # lazy: imaging loads when an image is queried

        upload.file.seek(0)
        data = upload.file.read()  # the spooled upload (on disk beyond 1 MiB): read in the worker
        if not data:
            raise HTTPException(400, f"{upload.filename or 'the upload'} is empty: send an image file")
        try:
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size
                if w * h > config.max_image_pixels:
                    raise HTTPException(413, f"the image has {w}x{h} pixels, more than the limit of "
                                             f"{config.max_image_pixels}: send a smaller image")
                return decode_8bit(img, upload.filename or "(the upload)")
        except HTTPException:
            raise
        except Image.DecompressionBombError as exc:  # PIL refuses to open beyond twice its own limit
            raise HTTPException(413, f"{upload.filename or 'the upload'} is too large to decode ({exc}): "
                                     "send a smaller image") from exc
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            why = "" if isinstance(exc, UnidentifiedImageError) else f": {exc}"
            raise HTTPException(400, f"{upload.filename or 'the upload'} is not an image PIL can read "
                                     f"(PNG, JPEG, PGM, ...){why}") from exc

    async def off_loop(fn: Any, *args: Any) -> Any:
        """``fn(*args)`` (decode + embed + search) in an image worker; 503 when all are busy."""
        try:
            return await image_work.run(fn, *args)
        except ServiceBusy as exc:
            raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from exc

    async def form_parts(request: Request, names: tuple[str, ...]) -> None:
        """Refuse a form with two parts of one name (the last one was used without a word)."""
        form = await request.form()  # parsed once: FastAPI's own read, cached on the request
        for name in names:
            if len(form.getlist(name)) > 1:
                raise HTTPException(422, f"the form has {len(form.getlist(name))} {name!r} parts: send one")

    def form_k(text: str | None) -> int:
        """The form's ``k`` by the rule of the JSON queries' (an integer as JSON writes one:
        ``3``, not ``3.0``, `` 3``, ``+3`` or ``03``; int() took the last three and FastAPI
        the first); none (or empty) is the default."""
        if text is None or text == "":
            return default_k
        if not re.fullmatch(r"-?(0|[1-9][0-9]*)", text):
            raise HTTPException(422, f"k must be a whole number of neighbours written as digits (3, not 3.0), "
                                     f"got {text[:20]!r}")
        if text.startswith("-") or text == "0":
            raise HTTPException(422, f"k must be at least 1, got {text[:20]}")
        if len(text) > 18:  # beyond any limit (Python's int() refuses thousands of digits)
            raise HTTPException(422, f"k={text[:20]}... is larger than this service's limit of {max_k}")
        k = int(text)
        return check_k(k)

    def need_model() -> Any:
        if embedder is None:
            raise HTTPException(409, "this service has no model: start it with --model RUN_DIR or an export "
                                     "to query by image")
        return embedder

    @app.get("/api/health", tags=["service"])
    def health() -> dict[str, Any]:
        """Liveness and what is loaded."""
        return {"status": "ok", "items": len(idx), "dim": idx.dim, "kind": idx.kind, "distance": idx.distance,
                "model": None if embedder is None else embedder.runtime, "verification": threshold is not None}

    @app.get("/api/info", tags=["service"])
    def info() -> dict[str, Any]:
        """The index (kind, settings, measured recall), limits and verification threshold."""
        d = idx.describe()
        if d.get("recall"):
            d["recall"] = {k: v for k, v in d["recall"].items() if k != "tried"}
        d["info"] = public_info(d.get("info"))
        return {"index": d, "threshold": threshold, "verify_distance": verify_distance, "max_k": max_k,
                "max_upload_bytes": config.max_upload_bytes,
                "model": None if embedder is None else embedder.runtime}

    @app.get("/api/metrics", tags=["service"])
    def get_metrics() -> dict[str, Any]:
        """Request counts, status classes and p50/p99 latency per route (last 1000 requests)."""
        return metrics.snapshot()

    @app.post("/api/query/embedding", response_model=SearchResponse, tags=["search"])
    def query_embedding(q: EmbeddingQuery) -> dict[str, Any]:
        """The k nearest items of an embedding."""
        # as sent (JSON numbers are float64): the search's check says "beyond float32's range"
        # or "below float32's smallest normal" (cast here, 1e39 became inf, blamed on NaN)
        vec = np.asarray(q.embedding, dtype=np.float64)[None]
        return results(vec, check_k(q.k))  # an all-zero one on a cosine index: refused by search (422)

    @app.post("/api/query/id", response_model=SearchResponse, tags=["search"])
    def query_id(q: IdQuery) -> dict[str, Any]:
        """The k nearest items of an indexed item."""
        check_k(q.k)
        try:
            vec = idx.get([q.id])
        except DataError as exc:
            raise HTTPException(404, str(exc)) from exc
        return results(np.asarray(vec, dtype=np.float32), q.k, exclude=q.id if q.exclude_self else None)

    @app.post("/api/query/image", response_model=SearchResponse, tags=["search"])
    async def query_image(request: Request, file: UploadFile = File(..., description="an image"),
                          k: str | None = Form(None, description=f"neighbours to return, 1 to {max_k} "
                                                                 f"(default {default_k}), as digits")
                          ) -> dict[str, Any]:
        """The k nearest items of an uploaded image (embedded with the served model)."""
        model = need_model()
        await form_parts(request, ("file", "k"))
        n = form_k(k)
        # async only to read the form: decoding and embedding block, so they run in an image
        # worker (on the event loop six 40 Mpx uploads held /api/health for 11.9 s)
        return await off_loop(lambda: results(model([read_image(file)]), n))

    @app.post("/api/verify", response_model=VerifyResponse, tags=["verification"])
    async def verify(request: Request, image1: UploadFile = File(...), image2: UploadFile = File(...)) -> dict[str, Any]:
        """Same or different identity/class: ``score >= threshold`` (threshold of `dmlkit verify`)."""
        model = need_model()
        if threshold is None:
            raise HTTPException(409, "this service has no verification threshold: start it with --threshold T or "
                                     "--verification FILE (the JSON of `dmlkit verify --json`)")
        await form_parts(request, ("image1", "image2"))

        def score() -> float:
            emb = model([read_image(image1), read_image(image2)])
            return float(pair_scores(emb, np.array([0]), np.array([1]), distance=verify_distance)[0])

        s = await off_loop(score)
        return {"same": s >= threshold, "score": s, "threshold": threshold, "distance": verify_distance}

    def indexed(name: str) -> bool:
        try:
            idx.positions([name])
        except DataError:
            return False
        return True

    logged_missing: set[str] = set()
    roots = [] if root_path is None else [root_path, Path(str(root)).absolute()]  # as resolved, as given

    def missing(item_id: str, why: str, path: Any = None) -> HTTPException:
        """A 404 naming the id, not the server's files (the path, if any, goes to the log)."""
        if path is not None and item_id not in logged_missing:
            logged_missing.add(item_id)  # once per item: a client cannot fill the log
            logger.warning("no thumbnail for %r: %s (%s)", item_id, why, path)
        return HTTPException(404, f"no image for {item_id!r}: {why}")

    def item_file(item_id: str) -> Path:
        """The image file of an indexed item: its metadata ``path``, else its id; a relative
        name under the data root (no ``..`` part), an absolute one only when it is an indexed id
        or lies under the data root (docs/search.md). The metadata path was taken as it was:
        ``{"path": "/etc/shadow"}`` made the server open that file."""
        meta = idx.metadata[idx.positions([item_id])[0]] if idx.metadata is not None else None
        given = (meta or {}).get("path")
        name = given if isinstance(given, str) and given else item_id
        p = Path(name)
        if not p.is_absolute():
            if root_path is None:
                raise HTTPException(404, f"no image for {item_id!r}: start the server with --data-root")
            inside = file_under_root(root_path, name)
            if inside is None:
                raise HTTPException(404, f"{item_id!r} points outside the data root")
            p = inside
        elif not (name == item_id or indexed(name)
                  or (".." not in p.parts and any(p.is_relative_to(r) for r in roots))):
            raise missing(item_id, "its metadata path is outside the data root and not an indexed id", p)
        if not p.is_file():
            raise missing(item_id, "its file is missing (the server's log names it)", p)
        return p

    @lru_cache(maxsize=4096)
    def thumbnail_bytes(path: str, item_id: str) -> bytes:
        """A PNG thumbnail of the file at ``path``; errors name ``item_id``, not the path."""
        from PIL import Image

        from dmlkit.data import upright_8bit  # lazy: imaging loads when a thumbnail is made

        try:
            with Image.open(path) as img:
                w, h = img.size
                if w * h > config.max_image_pixels:  # an upload's limit: decoding it ties up the server
                    raise DataError(f"it has {w}x{h} pixels, more than the limit of {config.max_image_pixels}")
                img = upright_8bit(img, repr(item_id)).convert("RGB")
                img.thumbnail((config.thumbnail_size, config.thumbnail_size))
                buf = io.BytesIO()
                img.save(buf, format="PNG")
                return buf.getvalue()
        except Image.DecompressionBombError as exc:  # not an OSError: it answered 500
            raise DataError(f"too large to decode ({exc})") from exc

    def known(item_id: str) -> int:
        try:
            return int(idx.positions([item_id])[0])
        except DataError as exc:
            raise HTTPException(404, str(exc)) from exc

    @app.get("/api/items/{item_id:path}/thumbnail", tags=["items"],
             responses={200: {"content": {"image/png": {}}}})
    def thumbnail(item_id: str, request: Request) -> Any:
        """A PNG thumbnail of an indexed item's image."""
        if not request.scope.get("raw_path", b"/thumbnail").endswith(b"/thumbnail"):
            return item(f"{item_id}/thumbnail")  # the id "a/thumbnail" sent as a%2Fthumbnail
        known(item_id)
        path = item_file(item_id)
        try:
            data = thumbnail_bytes(str(path), item_id)
        except DataError as exc:  # ours (too large, blank at 8 bits): they name the id
            raise HTTPException(404, f"the image of {item_id!r} cannot be read: {exc}") from exc
        except (OSError, ValueError, SyntaxError) as exc:  # their texts name the file: to the log only
            # PIL refuses some damaged files with ValueError (a zTXt/iCCP chunk that decompresses
            # past its 1 MB limit) or SyntaxError (a broken chunk while loading): they answered 500
            # with a traceback in the log; now the one-line 404 of any unreadable file
            raise missing(item_id, f"its file cannot be read as an image ({type(exc).__name__}; the server's "
                                   "log says more)", f"{path}: {exc}") from exc
        return Response(content=data, media_type="image/png", headers={"Cache-Control": "max-age=3600"})

    @app.get("/api/items/{item_id:path}", tags=["items"])
    def item(item_id: str) -> dict[str, Any]:
        """An indexed item's label and metadata."""
        pos = known(item_id)
        label = None if idx.labels is None else int(idx.labels[pos])
        if label is not None and idx.class_names is not None:  # string labels: the item's class name
            label = str(idx.class_names[label])
        return {"id": item_id, "label": label,
                "metadata": None if idx.metadata is None else idx.metadata[pos]}

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> FileResponse:
        files = {p.name: p for p in STATIC.iterdir() if p.is_file()}
        if name not in files:
            raise HTTPException(404, f"no static file {name!r}")
        return FileResponse(files[name])

    app.state.index, app.state.embedder, app.state.metrics = idx, embedder, metrics
    app.state.image_work = image_work
    return app


def _probe_image(embedder: Any) -> list[Any]:
    """A blank image of the size the model takes
    (:attr:`~dmlkit.apps.export.ImageEmbedder.reference_size`: a fixed-size export's own, such
    as 20x16 for a run without ``data.image_size``; else ``image_size`` or 64, square)."""
    from PIL import Image

    height, width = embedder.reference_size
    return [Image.new(embedder.mode, (width, height), color=128)]


def start_background_server(app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0
                            ) -> tuple[Any, threading.Thread, str]:
    """Serve ``app`` with uvicorn in a daemon thread; returns ``(server, thread, base_url)``.

    Stop it with ``server.should_exit = True; thread.join()``. ``port=0`` picks a free port.
    """
    uvicorn = require("uvicorn", "serve")
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True, name="dmlkit-serve")
    thread.start()
    deadline = time.time() + timeout
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise DmlkitError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()
    return server, thread, f"http://{bound[0]}:{bound[1]}"


def loopback_hosts(host: str) -> tuple[str, ...]:
    """The ``Host`` names a server bound to ``host`` answers by default: on ``localhost`` or a
    loopback address (all of 127.0.0.0/8, ``::1``) :data:`LOOPBACK_HOSTS` and the address
    itself; elsewhere none, i.e. no check (``()``)."""
    try:
        loopback = host.lower() == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return ()
    named = f"[{host.strip('[]')}]" if ":" in host else host
    return tuple(dict.fromkeys((*LOOPBACK_HOSTS, named.lower()))) if loopback else ()


def run_server(config: ServiceConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until interrupted (uvicorn, warnings and errors only: ``/api/metrics`` counts requests).

    The socket is bound here, so a port in use or out of range is one
    :class:`dmlkit.exceptions.ConfigError`; Ctrl-C stops the server gracefully and reaches the
    caller as :class:`KeyboardInterrupt` (``uvicorn.run`` swallowed it: the command exited 0).
    """
    import signal
    import socket

    uvicorn = require("uvicorn", "serve")
    if config.allowed_hosts is None and loopback_hosts(host):  # no DNS rebinding
        config = dataclasses.replace(config, allowed_hosts=loopback_hosts(host))
    app = create_app(config)
    if getattr(app.state.embedder, "runtime", None) == "torchscript":  # docs/search.md, "Trusting a model"
        print(f"note: {config.model} is a TorchScript export: a program, run as it is loaded and called "
              "(it can read the server's files); serve only exports you made, ONNX for models from others",
              file=sys.stderr, flush=True)
    if not loopback_hosts(host):
        warnings.warn(f"serving on {host}: reachable from other machines; put it behind a proxy with "
                      "authentication for anything but a trusted network", stacklevel=2)
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except (OSError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot listen on {host}:{port}: {reason} (choose another --port or --host)") from None
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    print(f"dmlkit serve: {len(app.state.index)} items on http://{host}:{bound_port}/ (API schema: /openapi.json)", flush=True)
    # Ctrl-C before uvicorn's loop starts leaves its coroutine unawaited: not worth a warning line
    warnings.filterwarnings("ignore", message="coroutine 'Server.serve' was never awaited", category=RuntimeWarning)
    with sock:
        server.run(sockets=[sock])  # re-raises a captured Ctrl-C once stopped, where it is not ignored
    if signal.SIGINT in getattr(server, "_captured_signals", ()):  # SIGINT ignored (a shell's background job)
        raise KeyboardInterrupt
