"""A visual search service over an :class:`~dmlkit.apps.EmbeddingIndex` (FastAPI + uvicorn).

``create_app(ServiceConfig(index=DIR, model=RUN_DIR_or_EXPORT))`` returns the ASGI app;
``run_server(config)`` serves it (127.0.0.1 unless told otherwise). See ``docs/search.md``.
"""

from dmlkit.apps.service.app import ServiceConfig, create_app, run_server, start_background_server

__all__ = ["ServiceConfig", "create_app", "run_server", "start_background_server"]
