"""Export a trained embedding model to ONNX or TorchScript, checked for parity on real images.

``export_model(run_dir, format="onnx")`` writes the model (batch axis dynamic) and a manifest
``<file>.json`` holding the preprocessing (transform preset, image size, channels) and the
parity figures measured on real test images of the run's dataset:

* numerical parity: ``max |f_torch(x) - f_export(x)|`` over all embedding entries;
* retrieval parity: the fraction of queries whose top-10 neighbour lists (exact cosine kNN
  within the sample, self excluded) are identical, their mean overlap, and MAP@R (Musgrave et
  al., ECCV 2020) computed from both sets of embeddings.

onnxruntime (CPU provider) is the reference runtime for ONNX. :func:`load_embedder` returns an
``images -> embeddings`` callable for a run directory or an export, used by ``dmlkit serve``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.data import get_transforms, upright_8bit
from dmlkit.data.transforms import PRESETS as TRANSFORM_PRESETS
from dmlkit.exceptions import (
    CheckpointError,
    ConfigError,
    DataError,
    DataNotFoundError,
    NonFiniteError,
    require,
)
from dmlkit.metrics import evaluate, knn
from dmlkit.training import build_datasets, load_checkpoint
from dmlkit.utils import atomic_write_json, os_error_message, read_json_object, sha256_file
from dmlkit.validation import check_integer, check_number

__all__ = ["EmbedderFailure", "ImageEmbedder", "export_model", "load_embedder", "parity_report"]

FORMATS = ("onnx", "torchscript")
_SUFFIX = {"onnx": ".onnx", "torchscript": ".pt"}
_MANIFEST_FORMAT = "dmlkit-export-v1"
#: The ONNX opset of an export unless the caller picks another.
_DEFAULT_OPSET = 17
#: The opsets ``torch.onnx.export`` takes when its private table cannot be read (torch 2.x).
_FALLBACK_OPSETS = (7, 20)


def _check_opset(opset: Any) -> int:
    """``opset`` as an integer in the range this torch's ONNX exporter supports
    (``torch.onnx._constants``), else one :class:`ConfigError` line before any work: outside it
    torch failed after the checkpoint and the images were loaded, ``10**23`` with a TypeError
    traceback."""
    try:
        from torch.onnx import _constants

        low, high = int(_constants.ONNX_MIN_OPSET), int(_constants.ONNX_MAX_OPSET)
    except (ImportError, AttributeError):  # a private module: a torch release may move it
        low, high = _FALLBACK_OPSETS
    return check_integer(opset, "--opset", least=low, most=high,
                         hint=f" (the default {_DEFAULT_OPSET} exports every dmlkit model)")


class EmbedderFailure(RuntimeError):
    """The model failed on input it accepts (out of memory, a broken ONNX session, ...): the
    server's fault, not the images'. ``dmlkit serve`` answers it with a 500 and logs the cause;
    images the model cannot take are refused as :class:`~dmlkit.exceptions.DataError` before
    the model runs (:meth:`ImageEmbedder.check_input`)."""


@dataclass
class ImageEmbedder:
    """``embedder(images) -> (N, D) float32`` for PIL images, with the model's preprocessing.

    ``forward`` maps a preprocessed ``(N, C, H, W)`` float32 array to embeddings; ``runtime``
    names it (``torch``, ``onnxruntime``, ``torchscript``). ``input_shape``: the ``(C, H, W)``
    the model takes (``None``: any size), where the runtime says (a fixed-size ONNX export).
    """

    forward: Callable[[np.ndarray], np.ndarray]
    transform: str | None
    image_size: int | None
    in_channels: int
    runtime: str
    batch_size: int = 64
    input_shape: tuple[int | None, ...] | None = None
    _smallest: int | None = field(default=None, init=False, repr=False)

    @property
    def mode(self) -> str:
        """The PIL mode images are converted to before the transform."""
        return "L" if self.in_channels == 1 else "RGB"

    @property
    def fixed_size(self) -> tuple[int, int] | None:
        """``(height, width)`` of a fixed-size export's input (``None``: the model takes other sizes)."""
        shape = self.input_shape
        if shape is None or len(shape) != 3 or shape[1] is None or shape[2] is None:
            return None
        return int(shape[1]), int(shape[2])

    @property
    def reference_size(self) -> tuple[int, int]:
        """``(height, width)`` of an image the model takes (``dmlkit serve`` embeds one at
        start-up): a fixed-size export's input size (a run without ``data.image_size`` exports
        its images' size, 20x16 for binary_alphadigits), else :attr:`reference_side` squared."""
        return self.fixed_size or (self.reference_side, self.reference_side)

    @property
    def reference_side(self) -> int:
        """The side of a square image the model takes: ``image_size`` (64 without one), or the
        shorter side of a fixed-size export's input."""
        fixed = self.fixed_size
        return min(fixed) if fixed is not None else self.image_size or 64

    def preprocess(self, images: Sequence[Any]) -> np.ndarray:
        """PIL images -> ``(N, C, H, W)`` float32 with the run's evaluation transform, each first
        read as the datasets read theirs (:func:`dmlkit.data.upright_8bit`: EXIF orientation;
        16-bit and float images scaled, which PIL's conversion clips to a blank image; a
        16-bit colour file at full depth only when passed undecoded, or read with
        :func:`dmlkit.data.decode_8bit` first, as ``dmlkit serve`` does). An image's errors
        name its file (``Image.open``'s ``filename``), else its place in ``images`` (``#0``)."""
        import torch

        if not images:
            raise DataError("no images to embed")
        t = get_transforms(self.transform or "none", train=False, image_size=self.image_size)
        out = []
        for i, img in enumerate(images):
            img = upright_8bit(img, getattr(img, "filename", None) or f"#{i}")
            x = t(img.convert(self.mode)) if t is not None else None
            if not isinstance(x, torch.Tensor):
                arr = np.asarray(img.convert(self.mode), dtype=np.float32) / 255.0
                x = torch.from_numpy(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))
            out.append(x)
        shapes = {tuple(x.shape) for x in out}
        if len(shapes) > 1:
            raise DataError(f"images preprocess to different shapes {sorted(shapes)}: the model's transform "
                            "must fix the size (set data.image_size)")
        return torch.stack(out).numpy().astype(np.float32, copy=False)

    def smallest_side(self) -> int:
        """The smallest square side the model embeds (found once, by embedding blank squares of
        sides up to :attr:`reference_side`): the pooling of a CNN that keeps the images' size
        needs a few pixels. :class:`EmbedderFailure` when even the reference side fails."""
        if self._smallest is None:
            def takes(side: int) -> bool:
                try:
                    self.forward(np.zeros((1, self.in_channels, side, side), dtype=np.float32))
                except (RuntimeError, MemoryError):
                    return False
                return True

            lo, hi = 1, self.reference_side
            if not takes(hi):
                raise EmbedderFailure(f"the {self.runtime} model cannot embed a blank {hi}x{hi} image")
            while lo < hi:  # the smallest side that works (pooling needs grow with the side)
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if takes(mid) else (mid + 1, hi)
            self._smallest = hi
        return self._smallest

    def check_input(self, x: np.ndarray) -> None:
        """Refuse, before the model runs, preprocessed images it cannot take: the wrong size for
        a fixed-size export, or (a model that takes other sizes) smaller than its
        :meth:`smallest_side` (:class:`DataError`)."""
        shape = tuple(int(v) for v in x.shape[1:])
        got = "x".join(map(str, shape))
        fixed = self.input_shape
        if fixed is not None and any(want is not None and want != have for want, have in zip(fixed, shape)):
            takes = "x".join("any" if v is None else str(v) for v in fixed)
            raise DataError(f"the model cannot embed images preprocessed to {got} (channels x height x width): "
                            f"it takes {takes}; send an image of the size the model was trained on")
        if self.fixed_size is not None:  # the size it takes: no blank squares to probe (they would fail)
            return
        side = min(shape[1:])
        if side < self.reference_side and side < self.smallest_side():
            raise DataError(f"the model cannot embed images preprocessed to {got} (channels x height x width): "
                            f"its smallest input side is {self.smallest_side()} pixels; send an image of the "
                            "size the model was trained on")

    def __call__(self, images: Sequence[Any]) -> np.ndarray:
        x = self.preprocess(images)
        self.check_input(x)  # the images' fault: a DataError before the model runs
        try:
            parts = [self.forward(x[i:i + self.batch_size]) for i in range(0, len(x), self.batch_size)]
        except (RuntimeError, MemoryError) as exc:  # input it takes: the model's (the server's) fault
            reason = (str(exc).strip().splitlines() or [""])[0][:200]
            raise EmbedderFailure(f"the {self.runtime} model failed on {len(x)} image(s) preprocessed to "
                                  f"{'x'.join(map(str, x.shape[1:]))}: {type(exc).__name__}: {reason}") from exc
        emb = np.concatenate(parts).astype(np.float32, copy=False)
        if not np.isfinite(emb).all():
            raise NonFiniteError("the model produced NaN/inf embeddings for these images")
        return emb


def _torch_forward(model: Any, device: str) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    def forward(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(np.ascontiguousarray(x)).to(device)).float().cpu().numpy()

    return forward


def _onnx_forward(path: Path) -> tuple[Callable[[np.ndarray], np.ndarray], tuple[int | None, ...] | None]:
    """``(forward, input (C, H, W))`` of an ONNX model (``None`` for a dimension the graph leaves free)."""
    ort = require("onnxruntime", "export")
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise CheckpointError(f"onnxruntime cannot load {path}: {exc}") from exc
    name = session.get_inputs()[0].name
    dims = list(session.get_inputs()[0].shape or [])
    shape = tuple(d if isinstance(d, int) and d > 0 else None for d in dims[1:]) if len(dims) == 4 else None

    def forward(x: np.ndarray) -> np.ndarray:
        try:
            return session.run(None, {name: np.ascontiguousarray(x, dtype=np.float32)})[0]
        except Exception as exc:  # onnxruntime's own types (Fail, InvalidArgument, ...) derive from Exception
            if type(exc).__module__.startswith("onnxruntime"):
                raise RuntimeError(str(exc)) from exc
            raise

    return forward, shape


def _torchscript_load(path: Path) -> Any:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return torch.jit.load(str(path), map_location="cpu").eval()
        except RuntimeError as exc:
            raise CheckpointError(f"{path} is not a TorchScript model: {exc}") from exc


def _manifest_path(model_file: Path) -> Path:
    return model_file.with_name(model_file.name + ".json")


def load_embedder(path: str | os.PathLike, device: str = "cpu") -> ImageEmbedder:
    """An :class:`ImageEmbedder` for a run directory/checkpoint or an exported ``.onnx``/``.pt``.

    Exports are read with the preprocessing stored in their manifest (``<file>.json``).
    """
    path = Path(path)
    if not path.exists():
        raise DataNotFoundError(f"model not found: {path} (a run directory from `dmlkit train` or an export)")
    if path.is_file() and path.suffix in (".onnx", ".pt", ".ts") and _manifest_path(path).exists():
        manifest = read_json_object(_manifest_path(path), "export manifest")
        if "sha256" in manifest and sha256_file(path) != manifest["sha256"]:
            raise DataError(f"{path} is not the model its manifest {_manifest_path(path).name} describes "
                            "(replaced after the export): export it again with `dmlkit export`")
        format, transform, image_size, in_channels = _manifest_settings(manifest, _manifest_path(path))
        shape = None
        if format == "onnx":
            (forward, shape), runtime = _onnx_forward(path), "onnxruntime"
        else:
            forward, runtime = _torch_forward(_torchscript_load(path), "cpu"), "torchscript"
        return ImageEmbedder(forward, transform, image_size, in_channels, runtime, input_shape=shape)
    if path.is_file() and path.suffix == ".onnx":
        raise DataError(f"{path} has no manifest {_manifest_path(path).name}: export it with `dmlkit export`")
    model, config = load_checkpoint(path, device=device)
    return ImageEmbedder(_torch_forward(model, device), config.data.transform, config.data.image_size,
                         int(config.model.in_channels), "torch")


@contextlib.contextmanager
def _native_stdout_silenced() -> Iterator[None]:
    """File descriptor 1 to ``/dev/null`` for the block: torch's TorchScript ONNX exporter turns
    its C++ log on whatever the setting and, on a failed export, prints the whole IR graph (65
    lines for a small CNN) to stdout, where a refused command must print nothing."""
    import ctypes

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 1)
        yield
    finally:
        try:
            ctypes.CDLL(None).fflush(None)  # C stdio's buffer goes to /dev/null, not to the restored stdout
        except (OSError, AttributeError):
            pass
        os.dup2(saved, 1)
        os.close(saved)


def _manifest_settings(manifest: dict[str, Any], where: Path) -> tuple[str, str | None, int | None, int]:
    """``(format, transform, image_size, in_channels)`` of an export manifest, each checked: a
    damaged or hand-edited manifest is one :class:`DataError`, not a ``KeyError`` at load."""
    def bad(what: str) -> DataError:
        return DataError(f"export manifest {where} is damaged ({what}): export the model again with `dmlkit export`")

    pre = manifest.get("preprocessing")
    if manifest.get("format") not in FORMATS:
        raise bad(f"format {manifest.get('format')!r} is not one of {list(FORMATS)}")
    if not isinstance(pre, dict):
        raise bad("no 'preprocessing' object")
    transform, size, channels = pre.get("transform"), pre.get("image_size"), pre.get("in_channels")
    if transform is not None and (not isinstance(transform, str) or transform.lower() not in TRANSFORM_PRESETS):
        raise bad(f"preprocessing.transform {transform!r} is not one of {list(TRANSFORM_PRESETS)}")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise bad(f"preprocessing.image_size {size!r} is not a positive integer")
    if channels not in (1, 3) or isinstance(channels, bool):
        raise bad(f"preprocessing.in_channels {channels!r} is not 1 or 3")
    return manifest["format"], transform, size, channels


def _is_export_manifest(path: Path) -> bool:
    """Whether ``path`` is a manifest :func:`export_model` wrote (a JSON object of its format)."""
    try:
        return read_json_object(path, "export manifest").get("manifest") == _MANIFEST_FORMAT
    except DataError:
        return False


def _refuse_foreign_outputs(out: Path, run_dir: Path) -> None:
    """Refuse, before anything is exported, an output that would replace a file that is not an
    earlier export: the model file ``out`` (replaced only when its manifest ``<out>.json`` is an
    export manifest), the manifest path itself, or the checkpoint being exported
    (:class:`DataError`). ``-o run/embeddings/test.npz`` replaced the run's embeddings with a
    model, ``-o run/checkpoints/best.pt`` the checkpoint itself, and ``-o run/metrics`` wrote
    the manifest over the run's ``metrics.json``."""
    checkpoints = run_dir if run_dir.is_file() else run_dir / "checkpoints"
    if out.resolve() == checkpoints.resolve() or (checkpoints.is_dir() and checkpoints.resolve() in out.resolve().parents):
        raise DataError(f"the output {out} would overwrite the checkpoints the export reads ({checkpoints}): "
                        "choose another output path (default RUN_DIR/export/model.onnx|.pt)")
    if out.is_dir():
        raise DataError(f"the output {out} is a directory: pass a file path such as {out / 'model.onnx'}")
    manifest = _manifest_path(out)
    if manifest.exists() and not _is_export_manifest(manifest):
        raise DataError(f"the export's manifest {manifest} would replace a file that is not an export manifest: "
                        "choose another output path")
    if out.exists() and not manifest.exists():
        raise DataError(f"{out} exists and is not a dmlkit export (no manifest {manifest.name} beside it): "
                        "choose another output path, or delete the file first")


def _knn_top(emb: np.ndarray, k: int) -> np.ndarray:
    return knn(emb, None, k=min(k, len(emb) - 1), distance="cosine").indices.numpy()


def _check_tolerance(value: Any, name: str, positive: bool = True) -> float:
    """``value`` as a finite float (:func:`dmlkit.validation.check_number`), > 0 (``positive``)
    or >= 0, else one :class:`ConfigError`. ``atol=inf`` passed any export, NaN failed every
    one and a negative value could never pass; none was refused."""
    what = "a finite number " + ("> 0" if positive else ">= 0")
    try:
        number = check_number(value, name, least=0.0)
    except ConfigError:
        raise ConfigError(f"{name} must be {what}, got {value!r}") from None
    if positive and number == 0.0:
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    return number


def parity_report(reference: np.ndarray, exported: np.ndarray, labels: np.ndarray, *,
                  atol: float = 1e-4, map_tol: float = 1e-3) -> dict[str, Any]:
    """Numerical and retrieval parity of two embeddings of the same images (see the module doc).

    ``passed`` when ``max_abs_diff <= atol`` and ``|MAP@R_ref - MAP@R_export| <= map_tol``
    (``atol``: finite, > 0; ``map_tol``: finite, >= 0; else :class:`ConfigError`).
    """
    atol, map_tol = _check_tolerance(atol, "atol"), _check_tolerance(map_tol, "map_tol", positive=False)
    if reference.shape != exported.shape:
        raise DataError(f"exported model gives shape {exported.shape}, PyTorch {reference.shape}")
    diff = float(np.max(np.abs(reference.astype(np.float64) - exported.astype(np.float64))))
    top_ref, top_exp = _knn_top(reference, 10), _knn_top(exported, 10)
    identical = float(np.mean(np.all(top_ref == top_exp, axis=1)))
    overlap = float(np.mean([len(np.intersect1d(a, b)) / a.size for a, b in zip(top_ref, top_exp)]))
    metrics = ["map_at_r", "precision_at_1"]
    m_ref = evaluate(reference, labels, metrics=metrics)
    m_exp = evaluate(exported, labels, metrics=metrics)
    return {
        "num_samples": int(len(reference)), "max_abs_diff": diff,
        "top10_identical": identical, "top10_overlap": overlap,
        "map_at_r_torch": m_ref["map_at_r"], "map_at_r_export": m_exp["map_at_r"],
        "precision_at_1_torch": m_ref["precision_at_1"], "precision_at_1_export": m_exp["precision_at_1"],
        "atol": atol, "map_tol": map_tol,
        # MAP@R is NaN on both sides when no sampled image has a same-class partner: that is
        # agreement, not a failure (``_parity_rows`` samples pairs so that it rarely happens)
        "passed": diff <= atol and bool(np.isclose(m_ref["map_at_r"], m_exp["map_at_r"], rtol=0.0,
                                                   atol=map_tol, equal_nan=True)),
    }


def _parity_rows(labels: np.ndarray, count: int) -> np.ndarray:
    """Up to ``count`` row numbers for the parity check, at least two of each class drawn, so
    that MAP@R and the top-10 lists are about neighbours of the same class: classes with two or
    more images spread evenly over the split, ``max(2, count // classes)`` images each (spread
    within the class); a split of single-image classes gives rows spread over it."""
    classes, inverse, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    multi = np.flatnonzero(sizes >= 2)
    if multi.size == 0:
        return np.unique(np.linspace(0, len(labels) - 1, num=min(count, len(labels))).round().astype(int))
    per = max(2, count // multi.size)
    picked: list[np.ndarray] = []
    taken = 0
    for c in multi[np.unique(np.linspace(0, multi.size - 1, num=min(multi.size, max(1, count // 2))).round()
                             .astype(int))]:
        rows = np.flatnonzero(inverse == c)
        take = min(per, rows.size, count - taken)
        if take < 2:
            break
        picked.append(rows[np.unique(np.linspace(0, rows.size - 1, num=take).round().astype(int))])
        taken += picked[-1].size
    return np.sort(np.concatenate(picked))


def _real_inputs(config: Any, data_root: Any, count: int) -> tuple[np.ndarray, np.ndarray, str]:
    """Up to ``count`` preprocessed real images (:func:`_parity_rows`) and their labels."""
    import torch

    for split in ("test", "val", "train"):
        ds = build_datasets(config, (split,), data_root=data_root).get(split)
        if ds is not None and len(ds) > 1:
            break
    else:
        raise DataError("the run's dataset has no split with two or more images for the parity check")
    if config.data.transform is not None and split == "train" and not config.model.frozen_trunk:
        ds = ds.with_transform(get_transforms(config.data.transform, train=False, image_size=config.data.image_size))
    rows = _parity_rows(np.asarray(ds.labels), count)
    xs, ys = [], []
    for r in rows:
        x, y = ds[int(r)]
        xs.append(x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x)))
        ys.append(int(y))
    return torch.stack(xs).float().numpy(), np.asarray(ys, dtype=np.int64), split


def export_model(run_dir: str | os.PathLike, format: str = "onnx", output: str | os.PathLike | None = None, *,
                 parity_samples: int = 256, data_root: str | os.PathLike | None = None, opset: int | None = None,
                 atol: float = 1e-4) -> dict[str, Any]:
    """Export the run's model and check parity on real images; returns (and stores) the report.

    Args:
        run_dir: run directory or checkpoint from ``dmlkit train``.
        format: ``onnx`` (legacy TorchScript-based ``torch.onnx.export``, dynamic batch axis) or
            ``torchscript`` (``torch.jit.trace``).
        output: model file (default ``RUN_DIR/export/model.onnx`` or ``model.pt``); the manifest
            with preprocessing and parity goes to ``<output>.json``. An existing file there is
            replaced only when it is an earlier export (:func:`_refuse_foreign_outputs`).
        parity_samples: real images of the run's test split used for the parity check (at least 12).
        opset: the ONNX opset (default 17, which exports every dmlkit model), within the range
            torch's exporter supports (7 to 23 with torch 2.14); ONNX only (:class:`ConfigError`
            with ``torchscript``).
        atol: the largest absolute embedding difference that passes (a finite number > 0;
            else :class:`ConfigError`), checked before any work.
    """
    import torch

    atol = _check_tolerance(atol, "atol")
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}: choose onnx or torchscript")
    if opset is not None and format != "onnx":  # it was ignored: a TorchScript file has no opset
        raise ConfigError(f"--opset applies to ONNX exports only, not --format {format}")
    opset = _DEFAULT_OPSET if opset is None else _check_opset(opset)
    if parity_samples < 12:
        raise ConfigError(f"parity_samples must be at least 12 (top-10 neighbours need 11 others), got {parity_samples}")
    run_dir = Path(run_dir)
    base = run_dir if run_dir.is_dir() else run_dir.parent
    out = Path(output) if output is not None else base / "export" / f"model{_SUFFIX[format]}"
    _refuse_foreign_outputs(out, run_dir)  # before the work: nothing but an earlier export is replaced
    model, config = load_checkpoint(run_dir, device="cpu")
    model.eval()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(os_error_message(exc, out.parent, writing=True)) from None
    x, labels, split = _real_inputs(config, data_root, parity_samples)
    example = torch.from_numpy(x[:2])
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    buffer = io.BytesIO()  # serialised in memory: a full or read-only disk is an OSError below,
    with warnings.catch_warnings():  # not an abort inside torch's C++ writer
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        if format == "onnx":
            require("onnx", "export")
            try:
                with _native_stdout_silenced():
                    torch.onnx.export(model, (example,), buffer, dynamo=False, input_names=["images"],
                                      output_names=["embeddings"], opset_version=opset,
                                      dynamic_axes={"images": {0: "batch"}, "embeddings": {0: "batch"}})
            except (torch.onnx.OnnxExporterError, RuntimeError, ValueError) as exc:
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
                raise ConfigError(f"ONNX export at opset {opset} failed: {reason} (the default "
                                  f"--opset {_DEFAULT_OPSET} exports every dmlkit model)") from None
        else:
            torch.jit.save(torch.jit.trace(model, example), buffer)
    data = buffer.getvalue()
    parity_file = _manifest_path(out)
    try:
        tmp.write_bytes(data)
        if format == "onnx":
            import onnx

            onnx.checker.check_model(str(tmp))
            forward, runtime = _onnx_forward(tmp)[0], "onnxruntime"
        else:
            forward, runtime = _torch_forward(_torchscript_load(tmp), "cpu"), "torchscript"
        reference = np.concatenate([_torch_forward(model, "cpu")(x[i:i + 64]) for i in range(0, len(x), 64)])
        exported = np.concatenate([forward(x[i:i + 64]) for i in range(0, len(x), 64)])
        parity = parity_report(reference, exported, labels, atol=atol)
        parity["split"] = split
        manifest = {
            "format": format, "manifest": _MANIFEST_FORMAT, "output": str(out), "runtime": runtime,
            "source": str(run_dir), "opset": opset if format == "onnx" else None,
            "preprocessing": {"transform": config.data.transform, "image_size": config.data.image_size,
                              "in_channels": int(config.model.in_channels), "input_shape": list(x.shape[1:])},
            "embedding_size": int(reference.shape[1]), "parity": parity,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        # the old manifest goes first: a kill before the new one leaves a model without a
        # manifest, which load_embedder refuses, never a new model described by the old one
        parity_file.unlink(missing_ok=True)
        os.replace(tmp, out)
        atomic_write_json(parity_file, manifest)
    except OSError as exc:
        raise DataError(os_error_message(exc, out, writing=True)) from None
    finally:
        tmp.unlink(missing_ok=True)
    manifest["parity_file"] = str(parity_file)
    return manifest
