"""The paper-scale profiles: layer sizes from the architectures, times from one throughput split by FLOPs."""

import math

import pytest

from bytescheduler_tools.sim.paper import MODELS, architecture, paper_profile, reported_seconds, reported_speedup

# Parameter counts as torchvision documents them (vgg16: 138,357,544; resnet50: 25,557,032), and
# the Transformer base of Vaswani et al. with a 37,000-token shared vocabulary, counted by hand:
# embedding 37000 x 512; an encoder layer 4 (512^2 + 512) + 2 (512 x 2048) + 2048 + 512 + 2 x 1024
# = 3,152,384; a decoder layer one more attention and norm: 4,204,032.
PARAMETERS = {"vgg16-v100": 138_357_544, "resnet50-v100": 25_557_032,
              "transformer-v100": 37000 * 512 + 6 * 3_152_384 + 6 * 4_204_032}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_parameter_tensor_is_there(name):
    profile = paper_profile(name)
    assert profile.gradient_bytes == 4 * PARAMETERS[name]
    assert sum(spec.parameters for spec in architecture(name).layers) == PARAMETERS[name]


def test_layer_shapes_follow_the_architectures():
    vgg = {spec.name: spec.shapes for spec in architecture("vgg16-v100").layers}
    assert vgg["conv1"] == ((64, 3, 3, 3), (64,)) and vgg["conv13"] == ((512, 512, 3, 3), (512,))
    assert vgg["fc6"] == ((4096, 25088), (4096,)) and vgg["fc8"] == ((1000, 4096), (1000,))
    resnet = {spec.name: spec.shapes for spec in architecture("resnet50-v100").layers}
    assert resnet["conv1"] == ((64, 3, 7, 7), (64,), (64,))
    assert resnet["layer1.0.downsample"][0] == (256, 64, 1, 1)
    assert resnet["layer4.2.conv3"][0] == (2048, 512, 1, 1) and resnet["fc"] == ((1000, 2048), (1000,))
    assert len([n for n in resnet if n.endswith("downsample")]) == 4 and len(resnet) == 1 + 16 * 3 + 4 + 1
    transformer = [spec.name for spec in architecture("transformer-v100").layers]
    assert transformer[0] == "embedding" and transformer[-1] == "output_projection"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_published_throughput_split_by_flops(name):
    model, profile = architecture(name), paper_profile(name)
    assert profile.compute_s == pytest.approx(model.batch / model.samples_per_s)
    assert profile.backward_s == pytest.approx(2 * profile.forward_s)
    assert profile.step_s == pytest.approx(20 * sum(s.parameters for s in model.layers) / 900e9)
    flops = [spec.flops for spec in model.layers]
    for spec, layer in zip(model.layers, profile.layers):
        assert layer.forward_s == pytest.approx(profile.forward_s * spec.flops / sum(flops))
    # Backward runs the layers in reverse: the first layer's gradients are ready last, at its end.
    ready = [layer.tensors[0].ready_s for layer in profile.layers if layer.tensors]
    assert ready == sorted(ready, reverse=True)
    assert ready[0] == pytest.approx(profile.backward_s)


def test_the_transformers_shared_embedding_is_ready_last_and_its_projection_costs_the_most():
    profile = paper_profile("transformer-v100")
    embedding, projection = profile.layers[0], profile.layers[-1]
    assert embedding.tensors[0].nbytes == 4 * 37000 * 512 and embedding.tensors[0].ready_s == profile.backward_s
    assert projection.tensors == () and projection.forward_s == max(layer.forward_s for layer in profile.layers)


def test_what_the_paper_reports():
    # Read off the figures: VGG-16 2.2x at 16 GPUs, ResNet-50 +5% at 64, the Transformer 2.7x at 16.
    assert reported_speedup("vgg16-v100", 16) == pytest.approx(2.25, abs=0.01)
    assert reported_speedup("resnet50-v100", 64) == pytest.approx(1.05, abs=0.01)
    assert reported_speedup("transformer-v100", 16) == pytest.approx(2.71, abs=0.01)
    assert reported_speedup("vgg16-v100", 8) == 1.0  # one machine: nothing to gain
    assert math.isnan(reported_speedup("vgg16-v100", 128))
    # The baseline's seconds per iteration at our batch: 32 images x 16 GPUs at 672 images/s.
    assert reported_seconds("vgg16-v100", 16) == pytest.approx(32 * 16 / 672)


def test_simulate_takes_a_paper_model(capsys):
    from bytescheduler.cli import main

    assert main(["simulate", "--model", "resnet50-v100", "--ranks", "16", "--bandwidth", "25gbit",
                 "--systems", "ddp", "scheduled"]) == 0
    out = capsys.readouterr().out
    assert "Profile resnet50-v100: 54 layers" in out and "| 16 | 25gbit | scheduled |" in out
