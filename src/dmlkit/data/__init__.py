"""Datasets, class-disjoint splits and transforms for metric learning.

>>> from dmlkit.data import load_dataset, default_split, get_transforms
>>> ds = load_dataset("omniglot")                      # doctest: +SKIP
>>> split = default_split(ds, val_fraction=0.2)        # doctest: +SKIP
>>> parts = split.apply(ds)                            # doctest: +SKIP
"""

from dmlkit.data.base import ArrayDataset, ImageFileDataset, MetricDataset, load_image
from dmlkit.data.datasets import (
    DATASETS,
    IMAGE_EXTENSIONS,
    canonical_dataset_name,
    load_dataset,
    register_dataset,
    verify_sha256,
)
from dmlkit.data.folders import load_csv, load_image_folder  # registers image_folder and csv
from dmlkit.data.imaging import decode_8bit, full_depth, to_8bit, upright_8bit, upright_image
from dmlkit.data.pairs import load_lfw  # registers the lfw loader
from dmlkit.data.reid import REID_DATASETS, ReidDataset  # registers the re-id loaders
from dmlkit.data.retrieval_benchmarks import (  # registers them
    load_cars196,
    load_cub200,
    load_inshop,
    load_sop,
)
from dmlkit.data.splits import (
    ClassSplit,
    default_split,
    fold_split,
    kfold_class_partitions,
    split_classes,
)
from dmlkit.data.transforms import IMAGENET_MEAN, IMAGENET_STD, get_transforms

__all__ = [
    "DATASETS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "ArrayDataset",
    "canonical_dataset_name",
    "decode_8bit",
    "full_depth",
    "load_cars196",
    "load_csv",
    "load_cub200",
    "load_image_folder",
    "load_inshop",
    "load_lfw",
    "load_sop",
    "ClassSplit",
    "ImageFileDataset",
    "MetricDataset",
    "REID_DATASETS",
    "ReidDataset",
    "default_split",
    "fold_split",
    "get_transforms",
    "kfold_class_partitions",
    "load_dataset",
    "load_image",
    "to_8bit",
    "upright_8bit",
    "upright_image",
    "register_dataset",
    "split_classes",
    "verify_sha256",
]
