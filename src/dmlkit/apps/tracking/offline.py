"""Offline tracking sequences with exact ground truth, made from real photographs.

No tracking benchmark can be downloaded here, so sequences are composed from the real
photographs bundled with scikit-image (``skimage.data``: NASA's astronaut Eileen Collins,
Chelsea the cat, a coffee cup, a SpaceX rocket, a motorcycle, ...; textures brick / grass /
gravel, the Hubble deep field, coins, ...). Each sequence is:

* a **background**: one photograph, resized (aspect kept) to 1.6 times the frame's width or
  height, whichever needs the larger scale (so it may shrink: for 320 x 240 frames every
  bundled background becomes 512 pixels wide), seen through a frame window (320 x 240 by
  default) that pans slowly (camera motion);
* a **target**: a rectangular crop of another photograph, pasted at an integer position and
  an integer size; its centre follows a smooth random walk that bounces off the frame
  borders, and its size a smooth random walk in [0.6, 1.6] times its first size
  (**scale change**, aspect ratio preserved);
* a **distractor**: a second crop of the *same* photograph as the target (similar colours and
  texture), moving independently and drawn under the target;
* **partial occlusion**: during one or two events a crop of the background photograph
  (half the target's width, 1.3 times its height) sweeps across the target over 20 frames,
  covering up to about half of it;
* **illumination change**: the whole frame is multiplied by ``1 + A sin(2 pi t / P + phi)``
  with ``A`` in [0.2, 0.4] (clipped to [0, 255]).

The ground truth ``x, y, w, h`` is the pasted rectangle itself, hence exact (occluded
frames keep the full box, as in OTB); the files hold it 1-based, as GOT-10k and OTB write
theirs (``meta.json``'s ``box_index_base``), and the loaders read back the 0-based box. Every random draw comes from
``numpy.random.default_rng([seed, split, index])``: the same seed gives the same pixels.
Training and test sequences use disjoint photographs for targets and backgrounds, so a tracker
is tested on objects and scenes it never saw.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dmlkit.apps.tracking.datasets import BENCHMARK_INDEX_BASE, Sequence, check_index_base
from dmlkit.exceptions import ConfigError, require
from dmlkit.utils import atomic_write_json, atomic_write_text, directory_lock
from dmlkit.validation import check_integer, check_seed

TRAIN_OBJECTS = ("astronaut", "motorcycle_left", "immunohistochemistry", "retina")
TRAIN_BACKGROUNDS = ("brick", "grass", "camera", "moon")
TEST_OBJECTS = ("chelsea", "coffee", "rocket")
TEST_BACKGROUNDS = ("gravel", "hubble_deep_field", "coins")
#: Most sequences of a split (``--train``/``--test``): GOT-10k's training split has 9,335.
MAX_SEQUENCES = 10_000
#: Most frames of a sequence (``--frames``; OTB-100's longest has 3,872), and the largest frame
#: side (``--size``): a sequence is rendered in memory, frames x W x H x 3 bytes (10,000 frames
#: of 320 x 240: 2.3 GB). Larger values ran for ever or ended in a numpy traceback.
MAX_FRAMES, MAX_SIDE = 10_000, 4096
#: The lock file a build holds in its output folder (:func:`build_offline_dataset`).
BUILD_LOCK = "build.lock"


def load_photo(name: str) -> np.ndarray:
    """A photograph bundled with scikit-image as an ``(H, W, 3)`` uint8 array."""
    data = require("skimage.data", "tracking")
    if name == "motorcycle_left":
        img = data.stereo_motorcycle()[0]
    else:
        fn = getattr(data, name, None)
        if fn is None:
            raise ConfigError(f"scikit-image has no bundled photograph {name!r}")
        img = fn()
    img = np.asarray(img)
    if img.dtype != np.uint8:
        img = np.clip(img * (255.0 if img.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    return np.ascontiguousarray(img[:, :, :3])


def _resize(img: np.ndarray, w: int, h: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(img).resize((max(1, w), max(1, h)), Image.BILINEAR))


@dataclass
class SequenceSpec:
    """Parameters of one offline sequence (see the module docstring)."""

    name: str
    object_photo: str
    background_photo: str
    num_frames: int = 80
    frame_size: tuple[int, int] = (320, 240)  # (width, height)
    seed: int = 0
    occlusions: int = 1
    max_speed: float = 4.0


def _smooth_walk(rng: np.random.Generator, n: int, step: float, lo: float, hi: float,
                 start: float) -> np.ndarray:
    """A smooth random walk (random velocity, momentum 0.9) reflected into [lo, hi]."""
    out = np.empty(n)
    v, p = 0.0, start
    for t in range(n):
        v = 0.9 * v + rng.normal(0.0, step)
        p += v
        if p < lo:
            p, v = 2 * lo - p, abs(v)
        if p > hi:
            p, v = 2 * hi - p, -abs(v)
        out[t] = min(max(p, lo), hi)
    return out


def _motion(rng: np.random.Generator, n: int, lo: np.ndarray, hi: np.ndarray,
            max_speed: float) -> np.ndarray:
    """Centre trajectory ``(n, 2)`` (x, y): random accelerations, speed capped, bounces."""
    pos = rng.uniform(lo + 0.25 * (hi - lo), hi - 0.25 * (hi - lo))
    vel = rng.uniform(-max_speed, max_speed, size=2) * 0.5
    out = np.empty((n, 2))
    for t in range(n):
        vel = 0.92 * vel + rng.normal(0.0, max_speed * 0.25, size=2)
        speed = np.linalg.norm(vel)
        if speed > max_speed:
            vel *= max_speed / speed
        pos = pos + vel
        for k in range(2):
            if pos[k] < lo[k]:
                pos[k], vel[k] = 2 * lo[k] - pos[k], abs(vel[k])
            if pos[k] > hi[k]:
                pos[k], vel[k] = 2 * hi[k] - pos[k], -abs(vel[k])
        pos = np.clip(pos, lo, hi)
        out[t] = pos
    return out


def _check_sizes(num_frames: int, frame_size: tuple[int, int]) -> None:
    """2 to :data:`MAX_FRAMES` frames of 96 to :data:`MAX_SIDE` pixels a side, else one
    :class:`ConfigError` line."""
    if not 2 <= num_frames <= MAX_FRAMES:
        raise ConfigError(f"a sequence needs at least 2 and at most {MAX_FRAMES} frames (--frames), got {num_frames}")
    if not (96 <= frame_size[0] <= MAX_SIDE and 96 <= frame_size[1] <= MAX_SIDE):
        raise ConfigError(f"frame size (--size) must be at least 96 x 96 and at most {MAX_SIDE} x {MAX_SIDE}, "
                          f"got {tuple(frame_size)}")


def make_sequence(spec: SequenceSpec, photos: dict[str, np.ndarray] | None = None) -> Sequence:
    """Render one sequence in memory: frames ``(H, W, 3)`` uint8 and exact boxes ``(N, 4)``."""
    _check_sizes(spec.num_frames, spec.frame_size)
    fw, fh = spec.frame_size
    photos = photos if photos is not None else {}
    for name in (spec.object_photo, spec.background_photo):
        if name not in photos:
            photos[name] = load_photo(name)
    rng = np.random.default_rng(spec.seed)
    n = spec.num_frames

    # background: the photo at 1.6x the frame in one side (at least in the other), window panning slowly
    bg_src = photos[spec.background_photo]
    scale = max(1.6 * fw / bg_src.shape[1], 1.6 * fh / bg_src.shape[0])
    bg = _resize(bg_src, int(bg_src.shape[1] * scale), int(bg_src.shape[0] * scale))
    pan_x = _smooth_walk(rng, n, 0.15, 0, bg.shape[1] - fw, rng.uniform(0, bg.shape[1] - fw))
    pan_y = _smooth_walk(rng, n, 0.15, 0, bg.shape[0] - fh, rng.uniform(0, bg.shape[0] - fh))

    # target and distractor: two crops of one photograph
    obj_src = photos[spec.object_photo]
    oh_src, ow_src = obj_src.shape[:2]
    short = min(fw, fh)

    def crop(aspect: float) -> np.ndarray:
        side = rng.uniform(0.25, 0.45) * min(oh_src, ow_src)
        cw = int(min(ow_src - 1, side * np.sqrt(aspect)))
        ch = int(min(oh_src - 1, side / np.sqrt(aspect)))
        x0 = int(rng.integers(0, ow_src - cw))
        y0 = int(rng.integers(0, oh_src - ch))
        return obj_src[y0:y0 + ch, x0:x0 + cw]

    aspect = float(np.exp(rng.uniform(np.log(0.6), np.log(1.6))))
    target = crop(aspect)
    distractor = crop(float(np.exp(rng.uniform(np.log(0.6), np.log(1.6)))))
    base = rng.uniform(0.16, 0.24) * short  # geometric mean side of the first box
    base_w, base_h = base * np.sqrt(aspect), base / np.sqrt(aspect)
    scales = np.exp(_smooth_walk(rng, n, 0.006, np.log(0.6), np.log(1.6), 0.0))
    scales[0] = 1.0
    margin = 1.6 * base * np.sqrt(max(aspect, 1 / aspect)) / 2 + 2
    lo, hi = np.array([margin, margin]), np.array([fw - margin, fh - margin])
    centres = _motion(rng, n, lo, hi, spec.max_speed)
    d_centres = _motion(rng, n, lo, hi, spec.max_speed)
    d_scale = rng.uniform(0.8, 1.1)

    # occlusion events: (start frame, direction, a crop of the background photograph)
    events = []
    for _ in range(spec.occlusions):
        first = max(1, n // 5)
        start = int(rng.integers(first, max(first + 1, n - 20)))
        ph, pw = int(1.4 * base_h * 1.6), int(0.6 * base_w * 1.6)
        oy0 = int(rng.integers(0, max(1, bg_src.shape[0] - ph)))
        ox0 = int(rng.integers(0, max(1, bg_src.shape[1] - pw)))
        events.append((start, 1 if rng.random() < 0.5 else -1,
                       bg_src[oy0:oy0 + ph, ox0:ox0 + pw]))
    occlusion_frames = 20

    # illumination
    amp, period, phase = rng.uniform(0.2, 0.4), rng.uniform(0.6, 1.5) * n, rng.uniform(0, 2 * np.pi)

    frames, boxes = [], []
    for t in range(n):
        x0, y0 = int(pan_x[t]), int(pan_y[t])
        frame = bg[y0:y0 + fh, x0:x0 + fw].astype(np.float32)
        # distractor first, so the target stays on top
        dw = int(round(distractor.shape[1] / max(distractor.shape) * base * 1.2 * d_scale))
        dh = int(round(distractor.shape[0] / max(distractor.shape) * base * 1.2 * d_scale))
        _paste(frame, _resize(distractor, dw, dh), d_centres[t])
        w = max(4, int(round(base_w * scales[t])))
        h = max(4, int(round(base_h * scales[t])))
        bx, by = _paste(frame, _resize(target, w, h), centres[t])
        boxes.append([bx, by, w, h])
        for start, direction, occluder in events:
            if start <= t < start + occlusion_frames:
                u = (t - start) / (occlusion_frames - 1)  # sweeps 0 .. 1 across the target
                ow, oh = max(2, w // 2), int(h * 1.3)
                ox = bx - ow + (u if direction > 0 else 1 - u) * (w + ow)
                _paste(frame, _resize(occluder, ow, oh), np.array([ox + ow / 2, by + h / 2]))
        gain = 1.0 + amp * np.sin(2 * np.pi * t / period + phase)
        frames.append(np.clip(frame * gain, 0, 255).astype(np.uint8))
    return Sequence(spec.name, frames, np.asarray(boxes, dtype=np.float64))


def _paste(frame: np.ndarray, patch: np.ndarray, centre: np.ndarray) -> tuple[int, int]:
    """Paste ``patch`` centred at ``centre`` (x, y), clipped to the frame; returns its top-left."""
    ph, pw = patch.shape[:2]
    x = int(round(centre[0] - pw / 2))
    y = int(round(centre[1] - ph / 2))
    H, W = frame.shape[:2]
    fx0, fy0, fx1, fy1 = max(0, x), max(0, y), min(W, x + pw), min(H, y + ph)
    if fx1 > fx0 and fy1 > fy0:
        frame[fy0:fy1, fx0:fx1] = patch[fy0 - y:fy1 - y, fx0 - x:fx1 - x]
    return x, y


def offline_specs(split: str, count: int, num_frames: int, seed: int = 0,
                  frame_size: tuple[int, int] = (320, 240)) -> list[SequenceSpec]:
    """The specs of ``count`` sequences of the ``train`` or ``test`` split (disjoint photos).
    ``seed``: an integer in ``[0, 2**32)`` (:func:`dmlkit.validation.check_seed`; numpy's
    ``default_rng`` refuses negative ones with a traceback), else one :class:`ConfigError` line."""
    seed = check_seed(seed)
    if split not in ("train", "test"):
        raise ConfigError(f"split must be 'train' or 'test', got {split!r}")
    objects, backgrounds = (TRAIN_OBJECTS, TRAIN_BACKGROUNDS) if split == "train" else (
        TEST_OBJECTS, TEST_BACKGROUNDS)
    split_id = 0 if split == "train" else 1
    specs = []
    for i in range(count):
        obj = objects[i % len(objects)]
        bg = backgrounds[(i // len(objects) + i) % len(backgrounds)]
        rng = np.random.default_rng([seed, split_id, i])
        name = (f"GOT-10k_Train_{i + 1:06d}" if split == "train"
                else f"{obj.split('_')[0].capitalize()}{i + 1:02d}")
        specs.append(SequenceSpec(
            name=name, object_photo=obj, background_photo=bg, num_frames=num_frames,
            frame_size=frame_size, seed=int(rng.integers(2**31)),
            occlusions=1 + int(rng.random() < 0.5), max_speed=float(rng.uniform(2.5, 5.0)),
        ))
    return specs


def write_sequence(seq: Sequence, folder: Path, layout: str, quality: int = 95,
                   index_base: int = BENCHMARK_INDEX_BASE) -> Path:
    """Write frames (JPEG) and ground truth in the ``otb`` or ``got10k`` layout.

    The boxes (0-based in memory) are written with ``index_base`` added to ``x`` and ``y``: 1, as
    both benchmarks write theirs (MATLAB's convention), so that the loaders, which subtract the
    base, read back exactly the boxes written."""
    from PIL import Image

    folder = Path(folder)
    if layout == "otb":
        img_dir, gt_name, digits = folder / "img", "groundtruth_rect.txt", 4
    elif layout == "got10k":
        img_dir, gt_name, digits = folder, "groundtruth.txt", 8
    else:
        raise ConfigError(f"layout must be 'otb' or 'got10k', got {layout!r}")
    img_dir.mkdir(parents=True, exist_ok=True)
    for i in range(len(seq)):
        Image.fromarray(seq.frame(i)).save(img_dir / f"{i + 1:0{digits}d}.jpg", quality=quality)
    index_base = check_index_base(index_base)
    if index_base is None:
        raise ConfigError("write_sequence needs the index base to write the boxes in: 0 or 1")
    shifted = np.asarray(seq.boxes, dtype=np.float64) + np.array([index_base, index_base, 0.0, 0.0])
    lines = "\n".join(",".join(_number(v) for v in box) for box in shifted) + "\n"
    atomic_write_text(folder / gt_name, lines)
    return folder


def _number(v: float) -> str:
    """``v`` as written in a ground-truth file: an integer without decimals (``41``), any other
    value as Python's shortest round-trip form (``f"{v:g}"`` kept six digits: 1234567 -> 1.23457e+06)."""
    v = float(v)
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def _clear_earlier_build(out: Path) -> None:
    """Remove what an earlier :func:`build_offline_dataset` wrote to ``out`` (the sequences its
    ``meta.json`` lists and that file), so that its sequences do not mix with the new ones; a
    ``out`` holding anything else is a :class:`ConfigError`, before anything is removed. An
    unfinished build is cleared too: its ``meta.json``, written first, lists every sequence it
    was to write.

    Only plain sequence names are removed: a ``meta.json`` listing ``../x`` or an absolute path
    (a planted file, in a shared or received folder) is a :class:`ConfigError` before anything
    is removed (it made ``shutil.rmtree`` remove folders outside ``out``), and a listed sequence
    that is a symbolic link loses the link, never what it points to."""
    if not out.exists():
        return
    owned: set[Path] = set(out.glob(".meta.json.*.tmp"))  # a write of meta.json killed part-way
    meta_path = out / "meta.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        meta = {}  # not ours to read: its folders count as someone else's
    if isinstance(meta, dict) and {"train", "test"} <= set(meta):
        owned.add(meta_path)
        names = [(split, str(name)) for split in ("train", "test") if isinstance(meta[split], dict)
                 for name in meta[split]]
        bad = [name for _, name in names if Path(name).name != name or name in ("", "..") or "\0" in name]
        if bad:
            raise ConfigError(f"{meta_path} lists the sequence {bad[0]!r}, which is not a plain folder name "
                              "(an earlier build-data writes none such): nothing was removed; remove that "
                              "meta.json or name a new or empty folder")
        owned.update(out / split / name for split, name in names)
    foreign = [p for p in sorted(out.iterdir()) if p.name not in ("train", "test", BUILD_LOCK) and p not in owned]
    for split in ("train", "test"):
        if (out / split).is_dir():
            foreign += [p for p in sorted((out / split).iterdir()) if p not in owned]
        elif (out / split).exists():
            foreign.append(out / split)
    if foreign:
        raise ConfigError(f"{out} is not empty and holds {foreign[0]}, which an earlier build-data did not "
                          f"write ({len(foreign)} such entries): name a new or empty folder, or remove them")
    inside = out.resolve()  # train/ or test/ a link out of ``out``: refused before any removal
    outside = [p for p in owned if not p.parent.resolve().is_relative_to(inside)
               or not (p.is_symlink() or p.resolve().is_relative_to(inside))]
    if outside:
        raise ConfigError(f"{outside[0]} lies outside {out} (through a symbolic link): nothing was removed; "
                          "name a new or empty folder")
    for path in sorted(owned, key=lambda p: p == meta_path):  # meta.json last: a rerun after a
        if path.is_symlink():  # kill here still knows which sequences are its own
            path.unlink()  # the link, not what it points to
        elif path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def build_offline_dataset(
    out: str | Path, num_train: int = 24, num_test: int = 9, train_frames: int = 80,
    test_frames: int = 80, seed: int = 0, frame_size: tuple[int, int] = (320, 240),
    progress: bool = False,
) -> dict:
    """Write ``out/train`` (GOT-10k layout) and ``out/test`` (OTB layout) and ``out/meta.json``.

    ``seed`` is checked (:func:`dmlkit.validation.check_seed`) before anything is written: a
    negative one ended in numpy's ValueError traceback. An ``out`` that an earlier call wrote is
    rebuilt: the sequences its ``meta.json`` lists are removed first (a smaller build kept the
    earlier one's extra sequences, which training and evaluation then read); an ``out`` holding
    anything else is refused (:class:`ConfigError`) before anything is written. ``meta.json`` is
    written first with ``"complete": false`` and rewritten with ``true`` once every sequence is:
    the loaders refuse an unfinished build (:func:`~dmlkit.apps.tracking.datasets.check_offline_build`),
    and running the same call again replaces it. The build holds ``out/build.lock``
    (:func:`~dmlkit.utils.directory_lock`) from the clearing to the end: a second build into
    ``out`` meanwhile is refused (:class:`~dmlkit.exceptions.DmlkitError`), not mixed into it."""
    seed = check_seed(seed)
    out = Path(out)
    for frames in (train_frames, test_frames):  # the arguments before any removal
        _check_sizes(frames, frame_size)
    for name, option, count in (("num_train", "--train", num_train), ("num_test", "--test", num_test)):
        check_integer(count, f"{name} ({option})", least=0)  # -1 built no sequence without a word
        if count > MAX_SEQUENCES:  # 10**23 sequences were planned for ever
            raise ConfigError(f"at most {MAX_SEQUENCES} sequences per split ({option}), got {count}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file: name a folder for the offline sequences")
    # one build at a time: a second one into ``out`` cleared or rewrote the first's sequences as
    # it wrote them, and the folder then mixed both builds under one "complete" meta.json
    with directory_lock(out, BUILD_LOCK, f"another `dmlkit track build-data` is writing {out}: wait for "
                        "it to end, or build into another folder"):
        _clear_earlier_build(out)
        return _write_build(out, num_train, num_test, train_frames, test_frames, seed, frame_size, progress)


def _write_build(out: Path, num_train: int, num_test: int, train_frames: int, test_frames: int, seed: int,
                 frame_size: tuple[int, int], progress: bool) -> dict:
    """:func:`build_offline_dataset` into the cleared ``out``, whose lock the caller holds."""
    photos: dict[str, np.ndarray] = {}
    plan = [("train", s) for s in offline_specs("train", num_train, train_frames, seed, frame_size)]
    plan += [("test", s) for s in offline_specs("test", num_test, test_frames, seed, frame_size)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan), desc="sequences")
    # box_index_base: the boxes are written 1-based, as GOT-10k's and OTB's (builds of older
    # dmlkit wrote 0-based boxes and recorded no base: the loaders read those as 0-based)
    meta = {"seed": seed, "frame_size": list(frame_size), "complete": False,
            "box_index_base": BENCHMARK_INDEX_BASE, "train": {}, "test": {}}
    for split, spec in plan:
        meta[split][spec.name] = {
            "object": spec.object_photo, "background": spec.background_photo,
            "frames": spec.num_frames, "seed": spec.seed, "occlusions": spec.occlusions,
            "max_speed": spec.max_speed,
        }
    # first: marks the build unfinished (the loaders refuse it) and names every sequence it will
    # write (a rerun after an interruption clears them as its own)
    atomic_write_json(out / "meta.json", meta)
    for split, spec in plan:
        seq = make_sequence(spec, photos)
        layout, sub = ("got10k", out / "train" / spec.name) if split == "train" else (
            "otb", out / "test" / spec.name)
        write_sequence(seq, sub, layout)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    meta["complete"] = True
    atomic_write_json(out / "meta.json", meta)
    return meta
