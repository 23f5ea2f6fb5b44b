"""Applications of a trained embedding: retrieval index, verification and few-shot learning."""

from dmlkit.apps.fewshot import (
    checkpoint_image_embedder,
    few_shot_accuracy,
    load_omniglot_one_shot_runs,
    omniglot_one_shot_error,
    prototype_predict,
)
from dmlkit.apps.index import EmbeddingIndex, SearchResult
from dmlkit.apps.reid import ReidResult, evaluate_reid, k_reciprocal_distances, vehicleid_protocol
from dmlkit.apps.verification import (
    VerificationResult,
    kfold_threshold_accuracy,
    make_pairs,
    verify,
    verify_pair_list,
    verify_scores,
)

__all__ = [
    "EmbeddingIndex",
    "ReidResult",
    "SearchResult",
    "VerificationResult",
    "checkpoint_image_embedder",
    "evaluate_reid",
    "few_shot_accuracy",
    "k_reciprocal_distances",
    "kfold_threshold_accuracy",
    "load_omniglot_one_shot_runs",
    "make_pairs",
    "omniglot_one_shot_error",
    "prototype_predict",
    "vehicleid_protocol",
    "verify",
    "verify_pair_list",
    "verify_scores",
]
