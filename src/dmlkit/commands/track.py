"""``dmlkit track``: SiamFC tracking on frames or a video, training, OTB evaluation, offline data.

    dmlkit track --frames DIR|VIDEO --init-box x,y,w,h --weights RUN --out tracked.gif
    dmlkit track train configs/siamfc_offline.yaml --run-dir runs/siamfc
    dmlkit track evaluate --dataset otb DIR --weights RUN --out-dir eval/
    dmlkit track build-data offline/
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

from dmlkit.commands._console import echo_json
from dmlkit.limits import MAX_THREADS

track_app = typer.Typer(
    name="track",
    help="Visual object tracking with SiamFC: run on a video, train, evaluate (OTB OPE), build data.",
    invoke_without_command=True,
    no_args_is_help=False,
)


def register(app: typer.Typer) -> None:
    app.add_typer(track_app, name="track")


#: The trackers of ``--method``/``--methods``.
_METHODS = ("siamfc", "untrained", "ncc")


def _tracker(method: str, weights: Path | None, scales: int | None, seed: int, device: str,
             width: float | None = None):
    """A tracker by name: ``siamfc`` (needs weights), ``untrained`` (seeded random SiamFC) or ``ncc``."""
    from dmlkit.exceptions import ConfigError
    from dmlkit.validation import check_seed

    method = method.lower()
    if scales not in (None, 3, 5):  # for every method, ncc included (it has no scale search)
        raise ConfigError(f"--scales must be 3 (SiamFC-3s) or 5 (SiamFC-5s), got {scales}")
    if method == "ncc":
        from dmlkit.apps.tracking import NCCTracker

        return NCCTracker()
    import torch

    from dmlkit.apps.tracking import SiamFC, SiamFCTracker, TrackerConfig, load_siamfc

    if method == "siamfc":
        if weights is None:
            raise ConfigError("--weights is needed for --method siamfc: a run directory or "
                              "checkpoint from `dmlkit track train` (or use --method ncc)")
        model, cfg = load_siamfc(weights)
        width = model.width
    elif method == "untrained":
        if width is None:
            width = load_siamfc(weights)[0].width if weights is not None else 1.0
        torch.manual_seed(check_seed(seed, "--seed"))
        model, cfg = SiamFC(width=width), TrackerConfig()
    else:
        raise ConfigError(f"unknown tracker {method!r}: use siamfc, untrained or ncc")
    if scales is not None:  # the paper's search of that many scales; the checkpoint's other settings stay
        cfg = cfg.with_scales(scales)
    return SiamFCTracker(model, cfg, device=device)


#: Options that only some trackers use: option -> (parameter, the trackers using it, what it sets).
_TRACKER_OPTIONS = {
    "--weights": ("weights", ("siamfc", "untrained"), "the siamfc checkpoint (for untrained: its width)"),
    "--scales": ("scales", ("siamfc", "untrained"), "the SiamFC scale search"),
    "--width": ("width", ("untrained",), "the untrained network's width (siamfc has its checkpoint's)"),
    "--seed": ("seed", ("untrained",), "the untrained network's seed"),
    "--device": ("device", ("siamfc", "untrained"), "where the SiamFC network runs (ncc runs on the CPU)"),
    "--threads": ("threads", ("siamfc", "untrained"), "torch's CPU threads (ncc runs scikit-image code)"),
}


def _refuse_unused_options(ctx: typer.Context, methods: list[str], flag: str) -> None:
    """A :class:`ConfigError` for the first option given on the command line that none of
    ``methods`` uses (:data:`_TRACKER_OPTIONS`): it was silently ignored. ``--weights`` with
    ``untrained`` and ``--width`` counts as unused too (``--width`` replaces what it gives)."""
    from dmlkit.commands._options import given
    from dmlkit.exceptions import ConfigError

    chosen = {m.lower() for m in methods}
    for option, (param, users, what) in _TRACKER_OPTIONS.items():
        if not given(ctx, param):
            continue
        used = chosen & set(users)
        if option == "--weights" and used == {"untrained"} and given(ctx, "width"):
            raise ConfigError("--weights does not apply with --width to untrained: both set the untrained "
                              "network's width; drop one")
        if not used:
            raise ConfigError(f"{option} does not apply to {flag} {','.join(methods)}: it sets {what}, used only "
                              f"by {' and '.join(users)}; drop it")


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


@track_app.callback()
def run(
    ctx: typer.Context,
    frames: Path | None = typer.Option(None, "--frames", "--video", help="A folder of frames (natural order) or a video file."),
    init_box: str | None = typer.Option(None, "--init-box", help="The target in the first frame: x,y,w,h (pixels, 0-based: x, y of its top-left pixel counted from 0, as image viewers show)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the frames with boxes: .gif, .mp4/.avi, or a folder."),
    weights: Path | None = typer.Option(None, "--weights", "-w", help="SiamFC checkpoint or run directory from `dmlkit track train`."),
    method: str = typer.Option("siamfc", "--method", help="siamfc | untrained | ncc (template matching baseline)."),
    scales: int | None = typer.Option(None, "--scales", help="Search scales: 3 (SiamFC-3s) or 5 (SiamFC-5s); default: the checkpoint's, else 3."),
    boxes_out: Path | None = typer.Option(None, "--boxes", help="Write the boxes, one x,y,w,h per line, 0-based as --init-box (OTB's and GOT-10k's files are 1-based: add 1 to x and y)."),
    max_frames: int | None = typer.Option(None, "--max-frames", min=2, help="Track at most this many frames."),
    fps_out: float | None = typer.Option(None, "--fps", help="Frame rate of the written video/GIF: 0.01 to 1000 (a GIF: to 100; default: the input's, else 15)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    seed: int = typer.Option(0, "--seed", help="Seed of the untrained network."),
    width: float | None = typer.Option(None, "--width", help="Width of the untrained network (default: the checkpoint's, else 1.0)."),
    threads: int | None = typer.Option(None, "--threads", min=1, max=MAX_THREADS, help=f"torch CPU threads, 1 to {MAX_THREADS} (1 is fastest on a busy shared CPU)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Track one object through a folder of frames or a video, from its box in the first frame."""
    if ctx.invoked_subcommand is not None:
        return
    from dmlkit.exceptions import ConfigError

    if frames is None or init_box is None:
        if frames is None and init_box is None and out is None:
            typer.echo(ctx.get_help())
            raise typer.Exit(0)
        raise ConfigError("tracking needs --frames DIR|VIDEO and --init-box x,y,w,h")
    import numpy as np

    from dmlkit.apps.tracking import annotate, parse_box, read_video, write_frames
    from dmlkit.apps.tracking.datasets import Sequence
    from dmlkit.apps.tracking.render import check_fps, check_output, fps_limits
    from dmlkit.apps.tracking.tracker import check_box_in_frame, frame_size
    from dmlkit.utils import refuse_overwriting_inputs

    if out is not None:  # a wrong --out (e.g. boxes.txt) fails now, not after the whole video
        check_output(out)
        if out.suffix == "" and out.resolve() == frames.resolve():  # write_frames clears its old frames
            raise ConfigError(f"--out {out} is the --frames folder: name another folder for the frames with boxes")
    if fps_out is not None:  # finite and storable in --out (render.MIN_FPS .. MAX_GIF_FPS /
        # MAX_VIDEO_FPS), before any frame is tracked: inf or 0.001 ended in an OverflowError
        # after the whole video, inf wrote a GIF of 0-delay frames; 0 must not mean "the default"
        fps_out = check_fps(fps_out, out, "--fps")
    if boxes_out is not None and boxes_out.is_dir():
        raise ConfigError(f"--boxes {boxes_out} is a folder: name the text file to write")
    for written in (out, boxes_out):  # `--frames clip.mp4 -o clip.mp4` replaced the video
        if written is not None:
            refuse_overwriting_inputs(written, frames)
    _refuse_unused_options(ctx, [method], "--method")  # e.g. --seed with siamfc: silently unused
    _set_threads(threads)
    box = parse_box(init_box)
    tracker = _tracker(method, weights, scales, seed, device, width)  # bad options fail before reading
    frame_list, video_fps = read_video(frames, max_frames)
    if out is not None and fps_out is None:  # the input's rate (else 15), within what --out stores:
        # a 240 fps clip written as a GIF plays at GIF's fastest, 100 fps, not with 0-delay frames
        lo, hi = fps_limits(out)
        fps_out = min(max(video_fps if video_fps and math.isfinite(video_fps) else 15.0, lo), hi)
    seq = Sequence(Path(frames).stem, frame_list)
    first = seq.frame(0)
    check_box_in_frame(box, *frame_size(first), f"--init-box {init_box}")  # the CLI's name for it
    from rich.progress import Progress

    with Progress(transient=True, disable=as_json) as bar:
        task = bar.add_task("tracking", total=len(seq))
        result = tracker.track(seq, box, progress=lambda: bar.advance(task))
    if boxes_out is not None:
        from dmlkit.utils import atomic_write_text

        atomic_write_text(boxes_out, "\n".join(",".join(f"{v:.2f}" for v in b)
                                               for b in result.boxes) + "\n")
    if out is not None:
        write_frames(annotate(seq, result.boxes), out, fps_out)
    summary = {"frames": len(seq), "fps": float(result.fps), "method": method,
               "last_box": [round(float(v), 2) for v in result.boxes[-1]],
               "mean_peak_score": float(np.nanmean(result.scores[1:])) if len(seq) > 1 else None,
               "out": str(out) if out else None, "boxes": str(boxes_out) if boxes_out else None}
    if as_json:
        echo_json(summary)
    else:
        typer.echo(f"tracked {summary['frames']} frames at {summary['fps']:.1f} fps ({method}); "
                   f"last box {summary['last_box']}" + (f" -> {out}" if out else ""))


@track_app.command("train")
def train(
    config: Path = typer.Argument(..., help="A SiamFC YAML config (e.g. configs/siamfc_offline.yaml)."),
    run_dir: Path = typer.Option(Path("runs/siamfc"), "--run-dir", "-o", help="Where to write the run."),
    overrides: list[str] = typer.Option([], "--set", help="Override a config value: key=value (repeatable)."),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Training sequences (overrides data_dir)."),
    resume: bool = typer.Option(False, "--resume", help="Continue RUN_DIR from its last finished epoch."),
    max_epochs: int | None = typer.Option(None, "--max-epochs", min=1, help="Stop after this many epochs (resume later)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Train SiamFC on pairs of frames; writes RUN_DIR/checkpoints/last.pt after every epoch."""
    from dmlkit.apps.tracking import SiamFCTrainConfig, train_siamfc

    extra = list(overrides) + ([f"data_dir={data_dir}"] if data_dir else [])
    cfg = SiamFCTrainConfig.from_yaml(config, extra)
    result = train_siamfc(cfg, run_dir, progress=not quiet, resume=resume, max_epochs=max_epochs)
    typer.echo(f"trained {result['steps']} steps, {result['epochs']}/{cfg.epochs} epochs "
               f"({result['pairs']} pairs) in "
               f"{result['seconds']:.0f} s; loss {result['first_loss']:.4f} -> "
               f"{result['last_loss']:.4f}; checkpoint {result['checkpoint']}")


def _clear_earlier_boxes(out_dir: Path) -> None:
    """Remove the ``boxes/<method>/<sequence>.txt`` an earlier evaluation wrote into ``out_dir``
    (and the folders they leave empty): ``results.json`` is rewritten for this evaluation's
    methods and sequences, and the boxes of another method or sequence left beside it were not
    its. Other files stay."""
    boxes = out_dir / "boxes"
    if not boxes.is_dir():
        return
    for folder in [p for p in boxes.iterdir() if p.is_dir()]:
        for old in folder.glob("*.txt"):
            old.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()


def _write_evaluation(out_dir: Path, name: str, results: dict, boxes: dict, title: str, base: int) -> None:
    """Write method ``name``'s boxes, then ``results.json`` and ``ope.png`` of every method
    finished so far (``results``), each file atomically: an interrupted evaluation keeps them.
    The boxes (0-based in memory) are written in the index ``base`` of the ground-truth files
    they answer (1 for OTB and GOT-10k: ``x + 1, y + 1, w, h``), which ``results.json`` records
    per method (``box_index_base``), so that they compare with those files line by line."""
    import numpy as np

    from dmlkit.apps.tracking import plot_ope
    from dmlkit.utils import atomic_write_figure, atomic_write_json, atomic_write_text

    shift = np.array([base, base, 0.0, 0.0])
    for seq_name, b in boxes.items():
        atomic_write_text(out_dir / "boxes" / name / f"{seq_name}.txt",
                          "\n".join(",".join(f"{v:.2f}" for v in row) for row in np.asarray(b) + shift) + "\n")
    atomic_write_json(out_dir / "results.json",
                      {n: {**res.to_dict(), "box_index_base": base} for n, res in results.items()})
    # a figure on its own canvas (no pyplot state to close)
    atomic_write_figure(plot_ope(results, title=title), out_dir / "ope.png", dpi=120)


@track_app.command("evaluate")
def evaluate(
    ctx: typer.Context,
    root: Path = typer.Argument(..., help="The sequences' root folder."),
    dataset: str = typer.Option("otb", "--dataset", help="otb | got10k layout."),
    split: str | None = typer.Option(None, "--split", help="GOT-10k sub-folder (train / val)."),
    weights: Path | None = typer.Option(None, "--weights", "-w", help="SiamFC checkpoint or run directory."),
    methods: list[str] = typer.Option(["siamfc"], "--methods", "--method", help="Comma-separated or repeated: siamfc, untrained, ncc."),
    scales: int | None = typer.Option(None, "--scales", help="3 or 5 scales (default: the checkpoint's, else 3)."),
    out_dir: Path | None = typer.Option(None, "--out-dir", "-o", help="Write results.json, ope.png and the boxes here."),
    max_sequences: int | None = typer.Option(None, "--max-sequences", min=1, help="Evaluate the first N sequences."),
    device: str = typer.Option("cpu", "--device"),
    seed: int = typer.Option(0, "--seed", help="Seed of the untrained network."),
    width: float | None = typer.Option(None, "--width", help="Width of the untrained network (default: the checkpoint's, else 1.0)."),
    threads: int | None = typer.Option(None, "--threads", min=1, max=MAX_THREADS, help=f"torch CPU threads, 1 to {MAX_THREADS} (1 is fastest on a busy shared CPU)."),
    absent_frames: str = typer.Option("drop", "--absent-frames", help="Frames without a valid ground-truth box: drop (left out of the averages) or otb (kept as the OTB toolkit and pysot keep them: a failure for success, a success for precision; the rule of published OTB numbers)."),
    index_base: int | None = typer.Option(None, "--index-base", help="Index of the first pixel in the ground-truth files: 1 for OTB and GOT-10k; default: 1, or what a build-data folder's meta.json records (0 for builds of older dmlkit)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """OTB one-pass evaluation: success AUC (21 thresholds), precision at 20 px, fps; plots.

    The ground truth of every sequence is checked before any tracking; with --out-dir each
    method's boxes, results.json and ope.png are written as soon as it finishes."""
    from dmlkit.apps.tracking import (
        check_ground_truth,
        got10k_splits,
        load_tracking_dataset,
        run_ope,
    )
    from dmlkit.apps.tracking.datasets import BENCHMARK_INDEX_BASE, check_index_base
    from dmlkit.apps.tracking.evaluation import check_absent_frames
    from dmlkit.commands._options import listed
    from dmlkit.exceptions import ConfigError

    absent_frames = check_absent_frames(absent_frames)  # before any data is read
    check_index_base(index_base)
    _set_threads(threads)
    names = listed(methods)
    if not names:
        raise ConfigError("--methods needs at least one of siamfc, untrained, ncc")
    unknown = [n for n in names if n.lower() not in _METHODS]
    if unknown:  # before any data is read
        raise ConfigError(f"unknown tracker {unknown[0]!r}: use {', '.join(_METHODS)}")
    _refuse_unused_options(ctx, names, "--methods")  # e.g. --seed without untrained: silently unused
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():  # before any tracking
        raise ConfigError(f"--out-dir {out_dir} is a file: name a folder for results.json, ope.png and the boxes")
    if split is None and dataset.lower().replace("-", "") == "got10k" and (splits := got10k_splits(root)):
        # loading would take train, the split trackers learn from: a score nobody asked for
        raise ConfigError(f"{root} holds the GOT-10k splits {', '.join(splits)}: name the one to evaluate with "
                          "--split (val to measure a tracker; test is scored by GOT-10k's server)")
    sequences = load_tracking_dataset(dataset, root, split, index_base)[:max_sequences]  # frame paths only
    check_ground_truth(sequences)  # a sequence that cannot be scored failed after the others' tracking
    # every tracker before any runs: a missing --weights for the second must not fail after the first
    trackers = {name: _tracker(name, weights, scales, seed, device, width) for name in names}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        _clear_earlier_boxes(out_dir)
    results = {}
    for name, tracker in trackers.items():
        results[name], boxes = run_ope(tracker, sequences, progress=not as_json, absent_frames=absent_frames)
        if out_dir is not None:  # now, not after every method: a crash or Ctrl-C lost them all
            base = (sequences[0].index_base if sequences and sequences[0].index_base is not None
                    else BENCHMARK_INDEX_BASE)
            _write_evaluation(out_dir, name, results, boxes, f"OPE on {Path(root).name}", base)
    table = {name: res.summary() for name, res in results.items()}
    if as_json:
        echo_json(table)
        return
    from rich.markup import escape
    from rich.table import Table

    from dmlkit.commands._console import output_console

    # the root and the trackers' names are text, not rich markup ("[/x]" in a path raised MarkupError)
    t = Table(title=escape(f"OTB one-pass evaluation: {len(sequences)} sequences in {root} "
                           f"(absent frames: {absent_frames})"))
    for col in ("tracker", "success AUC (%)", "precision@20 (%)", "frames", "fps"):
        t.add_column(col, justify="left" if col == "tracker" else "right")
    for name, row in sorted(table.items(), key=lambda kv: -kv[1]["success_auc"]):
        t.add_row(escape(name), f"{100 * row['success_auc']:.2f}", f"{100 * row['precision_at_20']:.2f}",
                  str(row["num_frames"]), f"{row['fps']:.1f}" if row["fps"] else "-")
    output_console().print(t)
    if out_dir is not None:
        typer.echo(f"plots: {out_dir / 'ope.png'}; results: {out_dir / 'results.json'}")


@track_app.command("build-data")
def build_data(
    out: Path = typer.Argument(..., help="Output folder: train/ (GOT-10k layout) and test/ (OTB layout)."),
    train_sequences: int = typer.Option(24, "--train", min=0, help="Training sequences."),
    test_sequences: int = typer.Option(9, "--test", min=0, help="Test sequences."),
    frames: int = typer.Option(80, "--frames", min=2, help="Frames per sequence."),
    seed: int = typer.Option(0, "--seed"),
    size: str = typer.Option("320x240", "--size", help="Frame size WxH."),
) -> None:
    """Build offline sequences with exact boxes from scikit-image's bundled real photographs."""
    from dmlkit.apps.tracking import build_offline_dataset
    from dmlkit.exceptions import ConfigError

    try:
        fw, fh = (int(v) for v in size.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--size must be WxH, e.g. 320x240, got {size!r}") from None
    meta = build_offline_dataset(out, train_sequences, test_sequences, frames, frames, seed,
                                 (fw, fh), progress=True)
    typer.echo(f"wrote {len(meta['train'])} training sequences to {out / 'train'} (GOT-10k layout) "
               f"and {len(meta['test'])} test sequences to {out / 'test'} (OTB layout)")
