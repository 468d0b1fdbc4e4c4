"""Paper-scale profiles: VGG-16, ResNet-50 and a Transformer on one V100, as ByteScheduler ran them.

Every parameter tensor's shape is computed from the architecture, written down here
(:func:`architecture`); no framework is needed. The compute times come from one published
throughput per model, split over the layers by FLOPs, because no public source we found
gives per-layer V100 times for these models as the paper ran them:

- **Throughput per GPU**: the "Linear Scaling" bars of ByteScheduler's own figures (MXNet,
  parameter server, RDMA 100 Gbit/s, 8 V100 per machine: ``bytescheduler/docs/
  mxnet_ps_rdma_{vgg16,resnet50,transformer}_sync.png`` in github.com/bytedance/byteps,
  branch ``bytescheduler``), read off the PNGs and divided by their GPU count (64):
  VGG-16 98.7 images/s, ResNet-50 207 images/s, Transformer 2,498 tokens/s.
- **Batch per GPU**: 32 images (the ``--batch-size`` of that repository's example scripts);
  for the Transformer 3,125 target tokens (Vaswani et al. 2017 trained on batches of
  ~25,000 tokens over 8 GPUs). The paper's own batch sizes were not in the material we
  could read: both are assumptions, and the iteration time is batch / throughput.
- **Split**: forward one third of the iteration, backward two thirds (backward computes two
  products for each one of forward), each split over the layers by their forward FLOPs
  (multiply-adds x 2 per sample; a normalisation or an embedding lookup counts ~0, so
  those layers get ~no time; attention scores are left out: under 3% of a layer's FLOPs
  for sentences of ~25 tokens). A layer's gradients are ready when backward has run every
  later layer and the layer itself.
- **Step**: SGD with momentum reads weight, gradient and momentum and writes two of them,
  20 bytes per parameter, at the V100's 900 GB/s.

>>> profile = paper_profile("vgg16-v100")
>>> sum(t.nbytes for layer in profile.layers for t in layer.tensors) // 4  # parameters
138357544
>>> round(profile.compute_s, 3)  # 32 images at 98.7 images/s
0.324
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

from .profile import Layer, Profile, Tensor

# A V100's memory bandwidth (bytes/s) and what SGD with momentum moves per parameter.
V100_MEMORY_BYTES_PER_S = 900e9
STEP_BYTES_PER_PARAMETER = 20


@dataclass(frozen=True)
class LayerSpec:
    """A module that owns parameters: their shapes, and its forward FLOPs per sample."""

    name: str
    shapes: Tuple[Tuple[int, ...], ...]
    flops: float

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


@dataclass(frozen=True)
class PaperModel:
    """One of the paper's models on one V100: its layers and what one iteration computes."""

    layers: Tuple[LayerSpec, ...]
    batch: int  # samples per GPU per iteration (images, or target tokens)
    samples_per_s: float  # one GPU's throughput (see the module docstring)
    unit: str


def _vgg16() -> List[LayerSpec]:
    """VGG-16 (configuration D of Simonyan & Zisserman), 224x224 images, 1000 classes."""
    layers, channels, size = [], 3, 224
    for out in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if out == "M":
            size //= 2
            continue
        layers.append(LayerSpec(f"conv{len(layers) + 1}", ((out, channels, 3, 3), (out,)),
                                2.0 * size * size * out * channels * 9))
        channels = out
    for index, (inputs, outputs) in enumerate(((512 * 7 * 7, 4096), (4096, 4096), (4096, 1000))):
        layers.append(LayerSpec(f"fc{index + 6}", ((outputs, inputs), (outputs,)), 2.0 * inputs * outputs))
    return layers


def _conv_bn(name: str, inputs: int, outputs: int, kernel: int, size: int) -> LayerSpec:
    """A convolution without bias and its batch norm (weight and bias), ``size`` x ``size`` outputs."""
    return LayerSpec(name, ((outputs, inputs, kernel, kernel), (outputs,), (outputs,)),
                     2.0 * size * size * outputs * inputs * kernel * kernel)


def _resnet50() -> List[LayerSpec]:
    """ResNet-50 (He et al.; the stride in the 3x3 convolution, as torchvision), 224x224 images."""
    layers = [_conv_bn("conv1", 3, 64, 7, 112)]
    inputs, size = 64, 56  # after the stride-2 convolution and the max pool
    for stage, (width, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)), start=1):
        for block in range(blocks):
            step = stride if block == 0 else 1
            out_size = size // step
            name = f"layer{stage}.{block}"
            layers += [_conv_bn(f"{name}.conv1", inputs, width, 1, size),
                       _conv_bn(f"{name}.conv2", width, width, 3, out_size),
                       _conv_bn(f"{name}.conv3", width, 4 * width, 1, out_size)]
            if block == 0:
                layers.append(_conv_bn(f"{name}.downsample", inputs, 4 * width, 1, out_size))
            inputs, size = 4 * width, out_size
    layers.append(LayerSpec("fc", ((1000, 2048), (1000,)), 2.0 * 2048 * 1000))
    return layers


def _linear(name: str, inputs: int, outputs: int) -> LayerSpec:
    return LayerSpec(name, ((outputs, inputs), (outputs,)), 2.0 * inputs * outputs)


def _norm(name: str, width: int) -> LayerSpec:
    return LayerSpec(name, ((width,), (width,)), 0.0)


def _transformer(vocabulary: int = 37000, width: int = 512, hidden: int = 2048, depth: int = 6) -> List[LayerSpec]:
    """Transformer base (Vaswani et al. 2017): 6 + 6 layers, d=512, FFN 2048, one embedding of
    a ~37,000-token vocabulary shared by both inputs and the output projection; per target
    token (source and target sentences taken as equally long)."""
    def attention(name: str, cross: bool) -> List[LayerSpec]:
        if cross:  # queries from the decoder, keys and values from the encoder's output
            projections = [_linear(f"{name}.q_proj", width, width), _linear(f"{name}.kv_proj", width, 2 * width)]
        else:
            projections = [_linear(f"{name}.in_proj", width, 3 * width)]
        return projections + [_linear(f"{name}.out_proj", width, width)]

    layers = [LayerSpec("embedding", ((vocabulary, width),), 0.0)]
    for index in range(depth):
        name = f"encoder.{index}"
        layers += attention(f"{name}.self_attn", cross=False) + [_norm(f"{name}.norm1", width)]
        layers += [_linear(f"{name}.fc1", width, hidden), _linear(f"{name}.fc2", hidden, width),
                   _norm(f"{name}.norm2", width)]
    for index in range(depth):
        name = f"decoder.{index}"
        layers += attention(f"{name}.self_attn", cross=False) + [_norm(f"{name}.norm1", width)]
        layers += attention(f"{name}.cross_attn", cross=True) + [_norm(f"{name}.norm2", width)]
        layers += [_linear(f"{name}.fc1", width, hidden), _linear(f"{name}.fc2", hidden, width),
                   _norm(f"{name}.norm3", width)]
    # The output projection reads the shared embedding: its time, no tensor of its own.
    layers.append(LayerSpec("output_projection", (), 2.0 * vocabulary * width))
    return layers


MODELS: Dict[str, PaperModel] = {
    "vgg16-v100": PaperModel(tuple(_vgg16()), 32, 98.7, "images"),
    "resnet50-v100": PaperModel(tuple(_resnet50()), 32, 207.4, "images"),
    "transformer-v100": PaperModel(tuple(_transformer()), 3125, 2498.0, "tokens"),
}


def architecture(name: str) -> PaperModel:
    """The layers of a paper model (``vgg16-v100``, ``resnet50-v100``, ``transformer-v100``)."""
    if name not in MODELS:
        raise ValueError(f"unknown paper model {name!r}: use one of {', '.join(MODELS)}")
    return MODELS[name]


def paper_profile(name: str) -> Profile:
    """The profile of one rank (one V100) of a paper model; see the module docstring."""
    model = architecture(name)
    parameters = sum(spec.parameters for spec in model.layers)
    step_s = parameters * STEP_BYTES_PER_PARAMETER / V100_MEMORY_BYTES_PER_S
    compute_s = model.batch / model.samples_per_s - step_s  # forward and backward
    total_flops = sum(spec.flops for spec in model.layers)
    forward = [compute_s / 3 * spec.flops / total_flops for spec in model.layers]
    backward = [2 * seconds for seconds in forward]
    layers, done = [], sum(backward)
    for spec, forward_s, backward_s in zip(model.layers, forward, backward):
        # Backward runs the layers in reverse: this layer's gradients are ready once every
        # later layer's backward and its own have run.
        ready_s = done
        done -= backward_s
        tensors = tuple(Tensor(4 * math.prod(shape), ready_s) for shape in spec.shapes)
        layers.append(Layer(spec.name, forward_s, tensors))
    return Profile(name, tuple(layers), sum(backward), step_s)


# What ByteScheduler's figures report (the PNGs named in the module docstring, read off their
# pixels): speed of the baseline (MXNet PS) and of ByteScheduler, by GPU count, in the model's unit
# per second. MXNet PS over RDMA at 100 Gbit/s, 8 V100 per machine.
REPORTED: Dict[str, Dict[int, Tuple[float, float]]] = {
    "vgg16-v100": {8: (787, 787), 16: (672, 1511), 32: (1416, 2832), 64: (2737, 5411)},
    "resnet50-v100": {8: (1654, 1654), 16: (2535, 2934), 32: (5194, 5784), 64: (10994, 11593)},
    "transformer-v100": {8: (16421, 16421), 16: (14318, 38748), 32: (43855, 74793), 64: (107935, 144781)},
}
REPORTED_SETUP = "MXNet PS, RDMA 100 Gbit/s, 8 V100 per machine"


def reported_speedup(name: str, gpus: int) -> float:
    """ByteScheduler's speedup over its baseline in the paper's figure, or NaN when not reported.

    >>> round(reported_speedup("vgg16-v100", 16), 2)
    2.25
    """
    baseline, scheduled = REPORTED.get(name, {}).get(gpus, (float("nan"), float("nan")))
    return scheduled / baseline


def reported_seconds(name: str, gpus: int) -> float:
    """Seconds per iteration of the paper's baseline at ``gpus`` (its speed per GPU and our batch)."""
    baseline, _ = REPORTED.get(name, {}).get(gpus, (float("nan"), float("nan")))
    return architecture(name).batch * gpus / baseline
