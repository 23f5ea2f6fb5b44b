"""Audit fixes of the protocol's storage check and distributed launch (the bench runner,
``dmlkit.protocol.launch``, ``dmlkit.distributed``)."""

from __future__ import annotations

import copy

import pytest

from dmlkit.exceptions import ConfigError
from dmlkit.protocol.config import bench_config_from_dict

BASE = {
    "name": "t",
    "fixed": {
        "seed": 3,
        "data": {"dataset": "omniglot"},
        "model": {"trunk": "small_cnn", "pretrained": False, "embedding_size": 16},
        "sampler": {"classes_per_batch": 8, "samples_per_class": 4},
        "optimizer": {"preset": "cpu_quick"},
        "training": {"epochs": 1},
    },
    "protocol": {"trials": 3},
    "methods": [{"name": "triplet", "loss": {"name": "triplet"},
                 "search": {"loss.margin": {"low": 0.01, "high": 1.0}}}],
}


def _with_storage(url):
    data = copy.deepcopy(BASE)
    data["protocol"]["storage"] = url
    return bench_config_from_dict(data)


@pytest.mark.parametrize("url", ["mysql://alice@db/studies", "mysql+pymysql://alice:s3cret@db/studies",
                                 "oracle://alice@db/studies", "mssql+pyodbc://alice@db/studies"])
def test_an_unsupported_database_is_refused_naming_the_supported_ones(url):
    """Only SQLite and PostgreSQL are supported: a mysql:// URL passed validation (and failed
    later, inside Optuna / SQLAlchemy, or ran on an engine nobody tests)."""
    with pytest.raises(ConfigError, match=r"not supported.*sqlite:///.*postgresql://") as info:
        _with_storage(url)
    assert "s3cret" not in str(info.value)  # named by its scheme: the URL may hold a password


@pytest.mark.parametrize("url", ["sqlite:///tmp/x/study.db", "postgresql://alice@db:5432/studies",
                                 "postgres://alice@db/studies", "postgresql+psycopg://alice@db/studies"])
def test_sqlite_and_postgresql_urls_are_accepted(url):
    assert _with_storage(url).protocol.storage == url
