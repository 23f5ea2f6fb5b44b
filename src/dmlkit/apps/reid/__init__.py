"""Re-identification: the Market-1501 protocol (CMC, mAP, mINP), VehicleID, k-reciprocal re-ranking."""

from dmlkit.apps.reid.evaluation import (
    ReidResult,
    closeness_blocks,
    evaluate_reid,
    evaluate_reid_scores,
    ranked_examples,
)
from dmlkit.apps.reid.rerank import k_reciprocal_blocks, k_reciprocal_distances
from dmlkit.apps.reid.vehicleid import VehicleIDResult, draw_gallery, vehicleid_protocol

__all__ = [
    "ReidResult",
    "VehicleIDResult",
    "draw_gallery",
    "k_reciprocal_blocks",
    "k_reciprocal_distances",
    "ranked_examples",
    "vehicleid_protocol",
    "closeness_blocks",
    "evaluate_reid",
    "evaluate_reid_scores",
]
