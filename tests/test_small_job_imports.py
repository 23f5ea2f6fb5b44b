"""A small ``dmlkit evaluate`` costs little (issue 11.26): it loads none of the heavy optional
libraries (numba and its LLVM, scipy, scikit-learn, faiss, matplotlib: 0.1-0.2 GB of RSS), so
its memory is the interpreter's and torch's. Checked by module, not by RSS, so the test holds on
every CPU and torch build."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

HEAVY = ("numba", "llvmlite", "scipy", "sklearn", "faiss", "matplotlib", "optuna", "torchvision")

PROBE = """
import json, sys
from dmlkit.cli import main
try:
    main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "heavy": [m for m in json.loads(sys.argv[1]) if m in sys.modules]}))
"""


@pytest.mark.parametrize("metrics", ["precision_at_1,r_precision,map_at_r", "map", "pos_neg_js,recall_at_k"])
def test_small_evaluate_loads_no_heavy_library(tmp_path, metrics):
    rng = np.random.default_rng(0)
    path = tmp_path / "small.npz"
    np.savez(path, embeddings=rng.standard_normal((1000, 64)).astype(np.float32),
             labels=rng.integers(0, 20, 1000))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(HEAVY), "evaluate", str(path), "-m", metrics],
        capture_output=True, text=True, timeout=120, check=False,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] in (0, None), out.stderr
    assert result["heavy"] == [], f"{metrics} loaded {result['heavy']}"
