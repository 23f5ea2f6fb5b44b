"""dmlkit: deep metric learning done right.

Losses, miners, samplers and distances; exact, memory-bounded evaluation metrics; and the fair
benchmarking protocol of Musgrave et al., "A Metric Learning Reality Check" (ECCV 2020).
"""

from dmlkit.exceptions import (
    CheckpointError,
    ConfigError,
    DataError,
    DataNotFoundError,
    DependencyError,
    DmlkitError,
    NonFiniteError,
    ShapeError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DataNotFoundError",
    "DependencyError",
    "DmlkitError",
    "NonFiniteError",
    "ShapeError",
    "__version__",
]
