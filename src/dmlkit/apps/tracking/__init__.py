"""Visual object tracking with SiamFC (Bertinetto et al. 2016, arXiv:1606.09549).

* :mod:`~dmlkit.apps.tracking.model`: the fully-convolutional siamese network and ``xcorr``;
* :mod:`~dmlkit.apps.tracking.training`: training pairs, labels, logistic loss, the trainer;
* :mod:`~dmlkit.apps.tracking.tracker`: the multi-scale SiamFC tracker and an NCC baseline;
* :mod:`~dmlkit.apps.tracking.evaluation`: OTB one-pass evaluation (success / precision);
* :mod:`~dmlkit.apps.tracking.datasets`: GOT-10k / OTB readers, frame folders and videos;
* :mod:`~dmlkit.apps.tracking.offline`: sequences with exact ground truth from real photos.
"""

from dmlkit.apps.tracking.datasets import (
    Sequence,
    box_index_base,
    got10k_splits,
    load_got10k,
    load_otb,
    load_tracking_dataset,
    read_boxes,
    read_video,
)
from dmlkit.apps.tracking.evaluation import (
    ABSENT_FRAMES,
    PRECISION_THRESHOLDS,
    SUCCESS_THRESHOLDS,
    OPEResult,
    SequenceResult,
    center_error,
    check_ground_truth,
    evaluate_ope,
    evaluate_sequence,
    overlap,
    plot_ope,
    precision_curve,
    run_ope,
    success_curve,
)
from dmlkit.apps.tracking.geometry import crop_and_resize, exemplar_side, parse_box
from dmlkit.apps.tracking.model import SiamFC, SiamFCBackbone, xcorr
from dmlkit.apps.tracking.offline import build_offline_dataset, make_sequence, offline_specs
from dmlkit.apps.tracking.render import annotate, draw_box, write_frames
from dmlkit.apps.tracking.tracker import (
    BaseTracker,
    NCCTracker,
    SiamFCTracker,
    TrackerConfig,
    TrackResult,
)
from dmlkit.apps.tracking.training import (
    PairConfig,
    SiamFCPairs,
    SiamFCTrainConfig,
    load_siamfc,
    logistic_loss,
    make_labels,
    save_siamfc,
    train_siamfc,
)

__all__ = [
    "ABSENT_FRAMES",
    "PRECISION_THRESHOLDS",
    "SUCCESS_THRESHOLDS",
    "BaseTracker",
    "NCCTracker",
    "OPEResult",
    "PairConfig",
    "Sequence",
    "SequenceResult",
    "SiamFC",
    "SiamFCBackbone",
    "SiamFCPairs",
    "SiamFCTrainConfig",
    "SiamFCTracker",
    "TrackResult",
    "TrackerConfig",
    "annotate",
    "box_index_base",
    "build_offline_dataset",
    "center_error",
    "check_ground_truth",
    "crop_and_resize",
    "draw_box",
    "evaluate_ope",
    "evaluate_sequence",
    "exemplar_side",
    "got10k_splits",
    "load_got10k",
    "load_otb",
    "load_siamfc",
    "load_tracking_dataset",
    "logistic_loss",
    "make_labels",
    "make_sequence",
    "offline_specs",
    "overlap",
    "parse_box",
    "plot_ope",
    "precision_curve",
    "read_boxes",
    "read_video",
    "run_ope",
    "save_siamfc",
    "success_curve",
    "train_siamfc",
    "write_frames",
    "xcorr",
]
