"""Layouts of convolutional models: the default (NCHW) against channels-last (NHWC).

``dmlkit.models.to_device`` stores every CPU model with 2-D convolutions channels-last. This
measures why (and, with ``--device cuda``, whether a GPU should too): one training step
(forward, backward, Adam) and one forward of a larger batch,
for the quickstart's SmallCNN, ResNet-18 / ResNet-50, the EfficientNet-Lite0 and
BN-Inception trunks, and the applications' networks (SiamFC's embedding of search crops at the
CPU config's width 0.25; the patch networks 2ch and hardnet at the offline config's width
0.125, scoring pairs / describing patches), random weights, in both layouts, interleaved
rounds, medians; the ratio below 1 means channels-last is faster. Both layouts get the same
weights and batch; the model is converted in place (the batch stays NCHW, as in training).

Run:  python benchmarks/bench_memory_format.py [--rounds 3] [--threads 2] [--models smallcnn resnet18]
      python benchmarks/bench_memory_format.py --device cuda --batch-scale 8 [--bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

from dmlkit.models import SmallCNN, build_trunk, trunk_names

#: (name, batch for a step, batch for a forward, input side, input channels)
MODELS = {
    "smallcnn": (128, 512, 28, 1),
    "resnet18": (16, 32, 224, 3),
    "resnet50": (8, 16, 224, 3),
    "efficientnet_lite0": (8, 32, 224, 3),  # the frozen trunk of configs/att_faces_efficientnet.yaml
    "bn_inception": (8, 32, 224, 3),  # the default trunk of the cub200 / cars196 / sop presets
    "siamfc": (8, 3, 255, 3),  # dmlkit track: a step on search crops, a forward of one frame's 3 scales
    "patches_2ch": (128, 512, 32, 2),  # dmlkit patches: a pair as one 2-channel image
    "patches_hardnet": (128, 512, 32, 1),  # descriptors of single patches
}


class _Call(torch.nn.Module):
    """An application network through the method its application calls on a batch."""

    def __init__(self, net: torch.nn.Module, method: str) -> None:
        super().__init__()
        self.net, self.method = net, method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "score":  # the two patches of each pair are the two channels
            return self.net.score(x[:, :1], x[:, 1:])
        return getattr(self.net, self.method)(x)


def _build(name: str) -> torch.nn.Module:
    if name == "smallcnn":
        return SmallCNN(1, bn_neck=True)
    if name == "siamfc":
        from dmlkit.apps.tracking import SiamFC

        return _Call(SiamFC(width=0.25), "embed")
    if name.startswith("patches_"):
        from dmlkit.apps.patches.models import build_patch_model

        arch = name.removeprefix("patches_")
        return _Call(build_patch_model(arch, 32, 0.125), "score" if arch == "2ch" else "describe")
    if name in trunk_names():
        return build_trunk(name, pretrained=False)[0]
    return getattr(torchvision.models, name)()


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    def timed() -> float:
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    timed()  # warm-up
    return statistics.median(timed() for _ in range(repeats)) * 1000


def measure(name: str, rounds: int, repeats: int, device: torch.device, batch_scale: int = 1,
            bf16: bool = False) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = _build(name).to(device)
    step_batch, fwd_batch, side, channels = MODELS[name]
    x = torch.randn(step_batch * batch_scale, channels, side, side, device=device)
    big = torch.randn(fwd_batch * batch_scale, channels, side, side, device=device)
    optimizer = torch.optim.Adam(model.parameters())
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for layout, fmt in (("nchw", torch.contiguous_format), ("nhwc", torch.channels_last)):
            model.to(memory_format=fmt)

            def step() -> None:
                optimizer.zero_grad(set_to_none=True)
                with autocast():
                    loss = model(x).float().pow(2).sum()
                loss.backward()
                optimizer.step()

            def forward() -> None:
                with torch.no_grad(), autocast():
                    model(big)

            model.train()
            out.setdefault(f"{layout} step", []).append(_median_ms(step, repeats, device))
            model.eval()
            out.setdefault(f"{layout} forward", []).append(_median_ms(forward, max(2, repeats // 3), device))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=9, help="timed steps per round and layout")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-scale", type=int, default=1, help="multiply every batch (8 suits a GPU)")
    ap.add_argument("--bf16", action="store_true", help="under torch.autocast(bfloat16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} threads"
    print(f"torch {torch.__version__}, {where}, {args.rounds} interleaved rounds, batches x{args.batch_scale}"
          f"{', bfloat16 autocast' if args.bf16 else ''}")
    print("| model | what | NCHW ms | NHWC ms | NHWC / NCHW |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in args.models:
        res = measure(name, args.rounds, args.repeats, device, args.batch_scale, args.bf16)
        for what in ("step", "forward"):
            a, b = statistics.median(res[f"nchw {what}"]), statistics.median(res[f"nhwc {what}"])
            spread = lambda v: "-".join(f"{t:.0f}" for t in (min(v), max(v)))  # noqa: E731
            print(f"| {name} | {what} | {a:.1f} ({spread(res[f'nchw {what}'])}) | "
                  f"{b:.1f} ({spread(res[f'nhwc {what}'])}) | {b / a:.2f} |")


if __name__ == "__main__":
    main()
