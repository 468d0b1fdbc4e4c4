"""The examples' models, on random data (torch only): ``build(name) -> (model, make_batch)``.

``make_batch(batch_size, generator)`` gives ``(images, labels)``: 3x32x32 images and 10
classes, for ``cross_entropy(model(images), labels)``. ``vgg`` is the benchmarks' VGG-like
model (about 30 million parameters, most of them in its fully connected layers: a model
whose communication a slow link cannot hide), ``mlp`` a deep fully connected one, ``tiny``
a model for quick checks.
"""

import torch
from torch import nn


def _vgg() -> nn.Module:
    features, channels = [], 3
    for width in (64, 128, 256):  # two 3x3 convolutions per stage, then a 2x2 max-pool
        for _ in range(2):
            features += [nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            channels = width
        features.append(nn.MaxPool2d(2))
    # then six hidden layers of 2048 units and the classifier
    return nn.Sequential(*features, _dense(256 * 4 * 4, *[2048] * 6, 10))


def _dense(*sizes: int) -> nn.Module:
    layers = [nn.Flatten()]
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU(inplace=True)]
    layers[-1] = nn.Identity()  # no activation after the classifier
    return nn.Sequential(*layers)


BUILDERS = {
    "vgg": _vgg,
    "mlp": lambda: _dense(3 * 32 * 32, *[2048] * 8, 10),
    "tiny": lambda: _dense(3 * 32 * 32, 64, 10),
}
MODELS = tuple(BUILDERS)


def build(name: str):
    """The model ``name`` (one of :data:`MODELS`) and its batch maker."""
    def make_batch(batch_size: int, generator: torch.Generator):
        images = torch.randn(batch_size, 3, 32, 32, generator=generator)
        return images, torch.randint(0, 10, (batch_size,), generator=generator)

    return BUILDERS[name](), make_batch
