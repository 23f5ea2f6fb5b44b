"""Patch correspondence (Zagoruyko & Komodakis, CVPR 2015): do two image patches show the same 3D point?

* :mod:`~dmlkit.apps.patches.models`: 2ch, 2ch-deep, 2ch-2stream, siam, pseudo-siam,
  siam-2stream (decision networks), their ``-l2`` descriptor variants and ``hardnet``;
* :mod:`~dmlkit.apps.patches.training`: hinge / hinge-embedding / triplet training, pair scoring;
* :mod:`~dmlkit.apps.patches.matching`: n x m score matrices and mutual-nearest-neighbour matches;
* :mod:`~dmlkit.apps.patches.brown`: the Brown (PhotoTour) layout, read and written;
* :mod:`~dmlkit.apps.patches.offline`: real correspondences from scikit-image's photographs;
* :mod:`~dmlkit.apps.patches.protocol`: train on one subset, FPR95 on another, the paper's table.

FPR95 and ROC AUC live in :mod:`dmlkit.metrics.roc`.
"""

from dmlkit.apps.patches.brown import (
    BROWN_SUBSETS,
    PatchPairs,
    PatchSubset,
    load_subset,
    read_info,
    read_matches,
    read_patch_sheets,
    write_brown_subset,
)
from dmlkit.apps.patches.matching import PatchMatches, match_patches, mutual_matches, score_matrix
from dmlkit.apps.patches.models import (
    ARCHITECTURES,
    DECISION_ARCHITECTURES,
    DESCRIPTOR_ARCHITECTURES,
    PatchNet,
    build_patch_model,
    prepare_patches,
)
from dmlkit.apps.patches.offline import OFFLINE_SUBSETS, OfflineSpec, build_offline_dataset
from dmlkit.apps.patches.protocol import (
    PatchExperimentConfig,
    evaluate_patch_run,
    hardest_pairs_figure,
    load_patch_config,
    load_patch_model,
    results_table,
    run_patch_protocol,
)
from dmlkit.apps.patches.training import (
    PatchTrainingSettings,
    TrainSettings,
    hinge_embedding_loss,
    hinge_loss,
    score_pairs,
    train_patch_model,
)

__all__ = [
    "ARCHITECTURES",
    "BROWN_SUBSETS",
    "DECISION_ARCHITECTURES",
    "DESCRIPTOR_ARCHITECTURES",
    "OFFLINE_SUBSETS",
    "OfflineSpec",
    "PatchExperimentConfig",
    "PatchMatches",
    "PatchNet",
    "PatchPairs",
    "PatchSubset",
    "PatchTrainingSettings",
    "TrainSettings",
    "build_offline_dataset",
    "build_patch_model",
    "evaluate_patch_run",
    "hardest_pairs_figure",
    "hinge_embedding_loss",
    "hinge_loss",
    "load_patch_config",
    "load_patch_model",
    "load_subset",
    "match_patches",
    "mutual_matches",
    "prepare_patches",
    "read_info",
    "read_matches",
    "read_patch_sheets",
    "results_table",
    "run_patch_protocol",
    "score_matrix",
    "score_pairs",
    "train_patch_model",
    "write_brown_subset",
]
