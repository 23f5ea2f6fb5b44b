"""Deprecated location of the frozen-trunk feature cache: it moved to :mod:`dmlkit.embeddings`.

``extract_features``, ``feature_cache_key`` and ``state_dict_digest`` stay importable from
here and from :mod:`dmlkit.models` (with a ``DeprecationWarning``); the embeddings stage owns
every inference loop.
"""

from __future__ import annotations

from typing import Any

MOVED = frozenset({"extract_features", "feature_cache_key", "state_dict_digest"})


def __getattr__(name: str) -> Any:
    if name not in MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    from dmlkit import embeddings  # lazy: deprecation shim of a name that moved up the layers

    warnings.warn(f"dmlkit.models.{name} moved to dmlkit.embeddings.{name}; import it from there",
                  DeprecationWarning, stacklevel=2)
    return getattr(embeddings, name)
