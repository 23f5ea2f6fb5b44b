"""Applications of a trained embedding: retrieval index, verification and few-shot learning."""

from dmlkit.apps.fewshot import (
    few_shot_accuracy,
    load_omniglot_one_shot_runs,
    omniglot_one_shot_error,
    prototype_predict,
)
from dmlkit.apps.index import EmbeddingIndex, SearchResult
from dmlkit.apps.verification import (
    VerificationResult,
    kfold_threshold_accuracy,
    make_pairs,
    verify,
)

__all__ = [
    "EmbeddingIndex",
    "SearchResult",
    "VerificationResult",
    "few_shot_accuracy",
    "kfold_threshold_accuracy",
    "load_omniglot_one_shot_runs",
    "make_pairs",
    "omniglot_one_shot_error",
    "prototype_predict",
    "verify",
]
