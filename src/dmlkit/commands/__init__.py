"""CLI sub-commands: each module defines ``register(app: typer.Typer)``; see :mod:`dmlkit.cli`.

Keep module-level imports light (no torch at import time) so that ``dmlkit --help`` is fast.
"""
