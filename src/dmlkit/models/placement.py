"""Where a model's weights live: the device, and the memory layout of its convolutions."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["to_device"]

#: Device types whose convolutions were measured faster channels-last.
_CHANNELS_LAST_DEVICES = ("cpu", "cuda")


def to_device(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Move ``model`` to ``device``; on CPU and CUDA a model with 2-D convolutions is also
    stored channels-last (NHWC), in place.

    oneDNN's CPU convolutions, pooling and BatchNorm and cuDNN's convolutions run faster on
    NHWC tensors, and a convolution whose weight is channels-last returns channels-last
    activations whatever the layout of its input, so the whole network follows without
    converting the batches.
    ``benchmarks/bench_memory_format.py`` on a 2-core AMD EPYC, torch 2.14, 2 threads, NHWC
    time / NCHW time: the quickstart's SmallCNN 0.59 a training step (128 x 1 x 28 x 28) and
    0.53 a forward of 512 images; at 224 x 224 ResNet-18 1.05 and 0.82, ResNet-50 0.99 and 0.92
    (the steps the same within noise), the EfficientNet-Lite0 trunk 0.75 and 0.72, BN-Inception
    0.87 and 0.62. On an NVIDIA H200 (torch 2.11, batches x8, float32): SmallCNN 0.68 and 0.82,
    ResNet-18 0.63 and 0.74, ResNet-50 0.76 and 0.81, EfficientNet-Lite0 0.78 and 0.70,
    BN-Inception 1.00 and 0.94 (under bfloat16 autocast 0.54-0.97). The values are the same up
    to float32 rounding (another summation order). Other devices keep the default layout (not
    measured).
    """
    device = torch.device(device)
    model.to(device)
    if device.type in _CHANNELS_LAST_DEVICES and any(isinstance(m, nn.Conv2d) for m in model.modules()):
        model.to(memory_format=torch.channels_last)
    return model
