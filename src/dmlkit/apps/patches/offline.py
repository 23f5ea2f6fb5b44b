"""Real patch correspondences built offline from the photographs bundled with scikit-image.

No download: every source image ships inside the ``scikit-image`` wheel. Two kinds of truth:

* **Stereo** (``skimage.data.stereo_motorcycle``: the Middlebury 2014 "Motorcycle" pair,
  rectified, with the ground-truth disparity ``d`` of the left view): a point ``(x, y)`` of the
  left image is the point ``(x - d, y)`` of the right image, two real views of one 3D point
  taken by two cameras. Two more views per point apply a random homography to the left and to
  the right view.
* **Homographies**: every other photograph is seen under ``views`` random homographies near the
  identity (rotation up to +-15 degrees, scale 2^(+-0.25), shear, perspective, shift), so a source
  point ``p`` is at ``H_k p`` in view ``k``.

Every view also gets a random photometric change: gain, offset, gamma, a linear shading
gradient, Gaussian blur and noise. Keypoints are Harris corners (``skimage.feature``) at least
``min_distance`` pixels apart whose 64 x 64 window lies inside the image in every view. The
patch of view ``k`` is the axis-aligned 64 x 64 window centred on the point in that view,
sampled bilinearly (``scipy.ndimage.map_coordinates``) through ``H_k^-1``.

Pairs, as in Brown et al.'s ``m50`` files: half positives (two different views of one point,
drawn without replacement), half negatives, of which ``hard_fraction`` pair a point with one
of its ``hard_neighbours`` nearest keypoints in the same image (overlapping, similar-looking
windows: the hard negatives of a matcher) and the rest two random points of the subset.

Three disjoint subsets (no source image in two of them) play Liberty / Notre Dame / Yosemite:
``stereo`` (the stereo pair and document images), ``photos`` (portraits, objects, a scene)
and ``textures`` (brick, grass, gravel, moon, coins). Everything is drawn from
``numpy.random.default_rng([seed, subset index])``: the same seed and scikit-image release
give byte-identical files; ``manifest.json`` records the settings, the versions, the count
of points per source image and a SHA-256 of every file.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dmlkit.apps.patches.brown import BUILD_MANIFEST, PATCH_SIZE, PatchPairs, write_brown_subset
from dmlkit.exceptions import ConfigError, DataError, require
from dmlkit.utils import atomic_write_json, directory_lock, read_json
from dmlkit.validation import check_integer, check_number, check_seed

__all__ = ["OFFLINE_SUBSETS", "OfflineSpec", "build_offline_dataset", "build_offline_subset"]

#: The lock file a build holds in its root (:func:`build_offline_dataset`).
BUILD_LOCK = "build.lock"

#: Source images of each subset (``skimage.data`` names; ``stereo_motorcycle`` is the stereo pair).
OFFLINE_SUBSETS: dict[str, tuple[str, ...]] = {
    "stereo": ("text", "page", "hubble_deep_field", "stereo_motorcycle"),
    "photos": ("chelsea", "coffee", "rocket", "astronaut", "camera"),
    "textures": ("moon", "coins", "brick", "grass", "gravel"),
}
#: Most views per point (``--views``): 2000 points x 32 views of 64 x 64 bytes hold 250 MiB;
#: ``10**23`` views ran for ever.
MAX_VIEWS = 32
#: Most pairs in a match file (``--train-pairs``/``--test-pairs``): 20x Brown's largest file
#: (500k pairs); ``10**23`` ended in numpy's OverflowError traceback.
MAX_PAIRS = 10**7


@dataclass(frozen=True)
class OfflineSpec:
    """How the offline subsets are made; the defaults build the dataset of ``docs/patches.md``."""

    points_per_subset: int = 2000
    views: int = 4
    train_pairs: int = 20000
    test_pairs: int = 10000
    hard_fraction: float = 0.5
    hard_neighbours: int = 8
    min_distance: int = 5
    harris_threshold_rel: float = 0.0005
    max_rotation_deg: float = 15.0
    max_log2_scale: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        """Every field checked, one :class:`ConfigError` naming it: ``views=2.5`` was a raw
        ``TypeError``, ``max_rotation_deg=nan`` a raw ``OverflowError``, and ``hard_neighbours=0``
        or ``min_distance=0`` were taken (no hard negative; keypoints on adjacent pixels)."""
        for name, value in (("points_per_subset (--points)", self.points_per_subset), ("views (--views)", self.views),
                            ("train_pairs (--train-pairs)", self.train_pairs),
                            ("test_pairs (--test-pairs)", self.test_pairs)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ConfigError(f"{name} must be a whole number, got {value!r}")
        check_integer(self.hard_neighbours, "hard_neighbours", hint=" (the nearest keypoints hard negatives come from)")
        check_integer(self.min_distance, "min_distance", hint=" (pixels between keypoints)")
        for name in ("hard_fraction", "harris_threshold_rel", "max_rotation_deg", "max_log2_scale"):
            check_number(getattr(self, name), name, least=0.0)
        if self.harris_threshold_rel > 1.0:
            raise ConfigError(f"harris_threshold_rel must be in [0, 1] (of the strongest corner), got {self.harris_threshold_rel}")
        if self.views < 2:
            raise ConfigError(f"views (--views) must be >= 2 (a positive pair needs two views), got {self.views}")
        if not 0.0 <= self.hard_fraction <= 1.0:
            raise ConfigError(f"hard_fraction must be in [0, 1], got {self.hard_fraction}")
        small = {name: value for name, value in (("points_per_subset (--points)", self.points_per_subset),
                                                  ("train_pairs (--train-pairs)", self.train_pairs),
                                                  ("test_pairs (--test-pairs)", self.test_pairs)) if value < 10}
        if small:
            raise ConfigError("points_per_subset, train_pairs and test_pairs must be at least 10, got "
                              + ", ".join(f"{name} = {value}" for name, value in small.items()))
        for name, value, most in (("views (--views)", self.views, MAX_VIEWS),
                                  ("train_pairs (--train-pairs)", self.train_pairs, MAX_PAIRS),
                                  ("test_pairs (--test-pairs)", self.test_pairs, MAX_PAIRS)):
            if value > most:
                raise ConfigError(f"{name} must be at most {most}, got {value}")
        check_seed(self.seed)


def _gray(name: str) -> np.ndarray:
    data = require("skimage.data", "patches")
    from skimage.color import rgb2gray, rgba2rgb

    img = np.asarray(getattr(data, name)())
    if img.ndim == 3 and img.shape[2] == 4:
        img = rgba2rgb(img)
    if img.ndim == 3:
        img = rgb2gray(img)
    img = img.astype(np.float64)
    return img / 255.0 if img.max() > 1.0 else img


def _random_homography(rng: np.random.Generator, shape: tuple[int, int], spec: OfflineSpec) -> np.ndarray:
    """A homography near the identity about the image centre (3 x 3, maps source -> view)."""
    h, w = shape
    c = np.array([[1, 0, -w / 2], [0, 1, -h / 2], [0, 0, 1]], float)
    th = np.deg2rad(rng.uniform(-spec.max_rotation_deg, spec.max_rotation_deg))
    s = 2.0 ** rng.uniform(-spec.max_log2_scale, spec.max_log2_scale)
    aniso = 2.0 ** rng.uniform(-0.1, 0.1)
    shear = rng.uniform(-0.1, 0.1)
    a = s * np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]]) @ np.array([[aniso, shear], [0, 1 / aniso]])
    m = np.eye(3)
    m[:2, :2] = a
    m[:2, 2] = rng.uniform(-0.03, 0.03, 2) * np.array([w, h])
    m[2, :2] = rng.uniform(-0.3, 0.3, 2) / max(h, w)
    back = np.array([[1, 0, w / 2], [0, 1, h / 2], [0, 0, 1]], float)
    return back @ m @ c


def _apply(hm: np.ndarray, xy: np.ndarray) -> np.ndarray:
    p = np.c_[xy, np.ones(len(xy))] @ hm.T
    return p[:, :2] / p[:, 2:3]


_HALF = (PATCH_SIZE - 1) / 2.0
_GRID = np.arange(PATCH_SIZE) - _HALF


def _window_inside(hinv: np.ndarray, centres: np.ndarray, shape: tuple[int, int], margin: float = 1.0) -> np.ndarray:
    """Whether each view window (centred at ``centres``, view coords) maps inside the source image."""
    h, w = shape
    ok = np.ones(len(centres), bool)
    for dx in (-_HALF, _HALF):
        for dy in (-_HALF, _HALF):
            src = _apply(hinv, centres + np.array([dx, dy]))
            ok &= (src[:, 0] >= margin) & (src[:, 0] <= w - 1 - margin) & (src[:, 1] >= margin) & (src[:, 1] <= h - 1 - margin)
    return ok


def _sample(img: np.ndarray, hinv: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """64 x 64 windows centred at ``centres`` of the view ``img(H^-1 x)``, bilinear, float."""
    from scipy.ndimage import map_coordinates

    gx = centres[:, 0, None, None] + _GRID[None, None, :]
    gy = centres[:, 1, None, None] + _GRID[None, :, None]
    gx, gy = np.broadcast_arrays(gx, gy)
    src = _apply(hinv, np.c_[gx.ravel(), gy.ravel()])
    vals = map_coordinates(img, [src[:, 1], src[:, 0]], order=1, mode="nearest")
    return vals.reshape(len(centres), PATCH_SIZE, PATCH_SIZE)


def _photometric(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Blur, gain/offset/gamma, a shading gradient and noise on one whole view."""
    from scipy.ndimage import gaussian_filter

    h, w = img.shape
    out = gaussian_filter(img, rng.uniform(0.0, 1.2))
    out = np.clip(out, 0, 1) ** (2.0 ** rng.uniform(-0.5, 0.5))
    yy, xx = np.mgrid[0:h, 0:w]
    g = rng.uniform(-0.3, 0.3, 2)
    shade = 1.0 + g[0] * (xx / w - 0.5) + g[1] * (yy / h - 0.5)
    out = out * rng.uniform(0.7, 1.3) * shade + rng.uniform(-0.1, 0.1)
    out = out + rng.normal(0.0, rng.uniform(0.0, 0.02), out.shape)
    return np.clip(out, 0.0, 1.0)


def _keypoints(img: np.ndarray, spec: OfflineSpec) -> np.ndarray:
    from skimage.feature import corner_harris, corner_peaks

    rc = corner_peaks(corner_harris(img, sigma=1.5), min_distance=spec.min_distance, threshold_rel=spec.harris_threshold_rel)
    return rc[:, ::-1].astype(np.float64)  # (x, y)


def _source_views(name: str, rng: np.random.Generator, budget: int, spec: OfflineSpec):
    """Patches ``(P, V, 64, 64)`` float and point coordinates ``(P, 2)`` of one source."""
    if name == "stereo_motorcycle":
        data = require("skimage.data", "patches")
        from skimage.color import rgb2gray

        left_rgb, right_rgb, disp = data.stereo_motorcycle()
        left, right = rgb2gray(left_rgb), rgb2gray(right_rgb)
        pts = _keypoints(left, spec)
        xi, yi = pts[:, 0].astype(int), pts[:, 1].astype(int)
        d = disp[yi, xi]
        ok = np.isfinite(d) & (d > 0)
        pts, d = pts[ok], d[ok]
        shape = left.shape
        centres0 = [pts, pts - np.c_[d, np.zeros_like(d)]]
        views = []
        for k in range(spec.views):
            base = k % 2
            img = left if base == 0 else right
            hm = np.eye(3) if k < 2 else _random_homography(rng, shape, spec)
            views.append((img, hm, _apply(hm, centres0[base])))
    else:
        img0 = _gray(name)
        shape = img0.shape
        pts = _keypoints(img0, spec)
        views = []
        for _k in range(spec.views):
            hm = _random_homography(rng, shape, spec)
            views.append((img0, hm, _apply(hm, pts)))
    ok = np.ones(len(pts), bool)
    for _img, hm, c in views:
        ok &= _window_inside(np.linalg.inv(hm), c, shape)
    idx = np.flatnonzero(ok)
    if len(idx) == 0:
        raise DataError(f"no usable keypoint in skimage.data.{name}")
    idx = np.sort(rng.choice(idx, size=min(budget, len(idx)), replace=False))
    patches = np.empty((len(idx), spec.views, PATCH_SIZE, PATCH_SIZE), np.uint8)
    for k, (img, hm, c) in enumerate(views):
        view = _photometric(img, rng)
        patches[:, k] = np.round(_sample(view, np.linalg.inv(hm), c[idx]) * 255.0).astype(np.uint8)
    return patches, pts[idx]


def _pairs(
    rng: np.random.Generator, n: int, point_ids: np.ndarray, views: int, neighbours: list[np.ndarray], spec: OfflineSpec
) -> PatchPairs:
    """``n`` pairs of patch rows (patch row = point * views + view), half positive."""
    num_points = len(neighbours)
    n_pos = n // 2
    n_neg = n - n_pos
    a_v, b_v = np.triu_indices(views, k=1)
    n_all = num_points * len(a_v)  # every (point, pair of views)
    pick = rng.choice(n_all, size=n_pos, replace=n_pos > n_all)
    pt, pv = pick // len(a_v), pick % len(a_v)
    pl, pr = pt * views + a_v[pv], pt * views + b_v[pv]
    n_hard = int(round(spec.hard_fraction * n_neg))
    i = rng.integers(0, num_points, size=n_neg)
    j = rng.integers(0, num_points, size=n_neg)
    for q in range(n_hard):
        nb = neighbours[i[q]]
        if len(nb):
            j[q] = nb[rng.integers(0, len(nb))]
    same = i == j
    while same.any():
        j[same] = rng.integers(0, num_points, size=int(same.sum()))
        same = i == j
    nl = i * views + rng.integers(0, views, n_neg)
    nr = j * views + rng.integers(0, views, n_neg)
    left, right = np.r_[pl, nl], np.r_[pr, nr]
    flip = rng.random(n) < 0.5
    left, right = np.where(flip, right, left), np.where(flip, left, right)
    order = rng.permutation(n)
    left, right = left[order].astype(np.int64), right[order].astype(np.int64)
    label = (point_ids[left] == point_ids[right]).astype(np.int64)
    return PatchPairs(left, right, label)


def build_offline_subset(
    folder: str | Path, name: str, spec: OfflineSpec | None = None, sources: tuple[str, ...] | None = None
) -> dict:
    """Build one subset of :data:`OFFLINE_SUBSETS` into ``folder`` (Brown layout); returns its summary.

    ``sources`` replaces the subset's source images (``skimage.data`` names; small test sets).
    """
    from scipy.spatial import cKDTree

    spec = spec or OfflineSpec()
    if name not in OFFLINE_SUBSETS:
        raise ConfigError(f"unknown offline subset '{name}': choose one of {', '.join(OFFLINE_SUBSETS)}")
    rng = np.random.default_rng([spec.seed, list(OFFLINE_SUBSETS).index(name)])
    sources = tuple(sources) if sources else OFFLINE_SUBSETS[name]
    _skdata = require("skimage.data", "patches")

    for src in sources:
        if not hasattr(_skdata, src):
            raise ConfigError(f"'{src}' is not an image of skimage.data")
    all_patches, neighbours, per_source = [], [], {}
    offset = 0
    for s, src in enumerate(sources):
        # an equal share of what is left, so small images' shortfall goes to the later ones
        budget = (spec.points_per_subset - offset) // (len(sources) - s)
        patches, pts = _source_views(src, rng, budget, spec)
        tree = cKDTree(pts)
        k = min(spec.hard_neighbours + 1, len(pts))
        _, nn = tree.query(pts, k=k)
        nn = np.asarray(nn).reshape(len(pts), k)[:, 1:]
        neighbours.extend(list(nn + offset))
        all_patches.append(patches)
        per_source[src] = len(pts)
        offset += len(pts)
    patches = np.concatenate(all_patches)  # (P, V, 64, 64)
    num_points, views = patches.shape[:2]
    point_ids = np.repeat(np.arange(num_points, dtype=np.int64), views)
    src_index = np.repeat(np.arange(len(sources)), [per_source[s] for s in sources])
    image_ids = (src_index[:, None] * views + np.arange(views)[None, :]).ravel().astype(np.int64)
    pairs = {
        spec.train_pairs: _pairs(rng, spec.train_pairs, point_ids, views, neighbours, spec),
        spec.test_pairs: _pairs(rng, spec.test_pairs, point_ids, views, neighbours, spec),
    }
    write_brown_subset(folder, patches.reshape(-1, PATCH_SIZE, PATCH_SIZE), point_ids, image_ids, pairs)
    return {"points": int(num_points), "patches": int(num_points * views), "points_per_source": per_source,
            "sources": list(sources)}


def build_offline_dataset(root: str | Path, spec: OfflineSpec | None = None, subsets: tuple[str, ...] | None = None) -> dict:
    """Build the offline subsets (default all three) under ``root`` and record them in
    ``root/manifest.json``: each subset's settings, scikit-image version, points per source and
    file digests. Subsets built earlier into the same root and not rebuilt now keep their
    records (with their own settings), so building one subset at a time loses nothing; the
    top-level ``spec`` and ``scikit_image`` are this build's. The manifest is the completion
    record: written without a subset before that subset is touched and with it once its files
    are all written, so it never lists a subset being (re)built; the subset of a killed build
    is refused by :func:`~dmlkit.apps.patches.brown.subset_folder`. The build holds
    ``root/build.lock`` (:func:`~dmlkit.utils.directory_lock`) throughout: a second build into
    ``root`` meanwhile is refused (:class:`~dmlkit.exceptions.DmlkitError`)."""
    skimage = require("skimage", "patches")

    spec = spec or OfflineSpec()
    if spec.train_pairs == spec.test_pairs:
        raise ConfigError("train_pairs and test_pairs must differ (they name the two m50 files)")
    root = Path(root)
    names = tuple(dict.fromkeys(subsets or OFFLINE_SUBSETS))
    for name in names:  # every name before the first subset is rebuilt
        if name not in OFFLINE_SUBSETS:
            raise ConfigError(f"unknown offline subset '{name}': choose one of {', '.join(OFFLINE_SUBSETS)}")
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} is a file: name a folder for the offline subsets")
    # one build at a time: a second one read manifest.json before the first rewrote it (a
    # subset built and reported lost its record) and removed the first's staging folders
    with directory_lock(root, BUILD_LOCK, f"another `dmlkit patches build-data` is writing {root}: wait "
                        "for it to end, then run this one again, or build into another folder (-o)"):
        return _build_subsets(root, names, spec, skimage.__version__)


def _build_subsets(root: Path, names: tuple[str, ...], spec: OfflineSpec, skimage_version: str) -> dict:
    """:func:`build_offline_dataset` of ``names`` under ``root``, whose lock the caller holds."""
    summary: dict = {"spec": asdict(spec), "scikit_image": skimage_version,
                     "subsets": _earlier_subsets(root)}
    for name in names:
        # before the subset is touched: the manifest lists a subset only while its files are
        # complete, and `patches train` / `evaluate` refuse a built folder it does not list
        summary["subsets"].pop(name, None)
        atomic_write_json(root / BUILD_MANIFEST, summary)
        info = build_offline_subset(root / name, name, spec)
        info["spec"], info["scikit_image"] = asdict(spec), skimage_version
        info["sha256"] = {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((root / name).iterdir()) if p.is_file()
        }
        summary["subsets"][name] = info
        # after every subset: a later failure leaves a manifest that describes the files on disk
        atomic_write_json(root / BUILD_MANIFEST, summary)
    return summary


def _earlier_subsets(root: Path) -> dict:
    """The records of ``root/manifest.json`` for subsets still on disk, each
    with the settings it was built with (a record from before per-subset settings takes the
    manifest's); nothing from a missing or unreadable manifest."""
    try:
        earlier = read_json(root / BUILD_MANIFEST, BUILD_MANIFEST)
        kept = {name: dict(info) for name, info in earlier["subsets"].items() if (root / name).is_dir()}
        for info in kept.values():
            info.setdefault("spec", earlier.get("spec"))
            info.setdefault("scikit_image", earlier.get("scikit_image"))
        return kept
    except (OSError, DataError, KeyError, TypeError, AttributeError):  # DataError: corrupt or nested too deeply
        return {}
