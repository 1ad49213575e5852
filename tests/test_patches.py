"""``conv_patches`` against a per-position loop and the convolution itself (float64)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from dampednewton.math.patches import conv_patches

CONVOLUTIONS = {
    "conv1d-k5-s2-p1": nn.Conv1d(3, 2, 5, stride=2, padding=1),
    "conv1d-k3-dilation2-p2": nn.Conv1d(2, 2, 3, padding=2, dilation=2),
    "conv1d-k1": nn.Conv1d(4, 3, 1),
    "conv2d-k3x2-s(2,1)-p(1,0)": nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 0)),
    "conv2d-k3-dilation(1,2)": nn.Conv2d(2, 2, 3, dilation=(1, 2), padding=1),
    "conv3d-k2-s2-p1": nn.Conv3d(2, 2, 2, stride=2, padding=1),
    "conv3d-k(1,2,3)-dilation(2,1,1)": nn.Conv3d(1, 2, (1, 2, 3), dilation=(2, 1, 1)),
}
SPATIAL = {1: (11,), 2: (7, 6), 3: (5, 6, 7)}


def patches_by_loop(inputs, conv):
    """Read each output position's patch entry by entry."""
    dims = inputs.dim() - 2
    padded = nn.functional.pad(
        inputs, [p for pad in reversed(conv.padding) for p in (pad, pad)]
    )
    outputs = [
        (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
        for size, pad, dilation, kernel, stride in zip(
            inputs.shape[2:],
            conv.padding,
            conv.dilation,
            conv.kernel_size,
            conv.stride,
            strict=True,
        )
    ]
    rows = []
    for position in itertools.product(*(range(o) for o in outputs)):
        entries = []
        for channel in range(inputs.shape[1]):
            for tap in itertools.product(*(range(k) for k in conv.kernel_size)):
                index = [
                    position[d] * conv.stride[d] + tap[d] * conv.dilation[d]
                    for d in range(dims)
                ]
                entries.append(padded[(slice(None), channel, *index)])
        rows.append(torch.stack(entries, dim=1))
    return torch.stack(rows, dim=1)


@pytest.fixture(params=list(CONVOLUTIONS), ids=list(CONVOLUTIONS))
def case(request):
    conv = CONVOLUTIONS[request.param].double()
    dims = conv.weight.dim() - 2
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(
        3, conv.in_channels, *SPATIAL[dims], generator=generator, dtype=torch.float64
    )
    return conv, inputs


def patches_of(conv, inputs):
    return conv_patches(
        inputs,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
    )


def test_patches_equal_the_loop(case):
    conv, inputs = case
    patches = patches_of(conv, inputs)
    assert torch.equal(patches, patches_by_loop(inputs, conv))


def test_views_equal_the_loop_on_every_input(case):
    """The views' route (every input off the CPU, 2-D included)."""
    conv, inputs = case
    patches = conv_patches(
        inputs,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        views=True,
    )
    assert torch.equal(patches, patches_by_loop(inputs, conv))


def test_patches_on_the_device_equal_the_loop(case, device):
    """On CUDA the 2-D patches take the views route: the same patches."""
    conv, inputs = case
    patches = patches_of(conv, inputs.to(device))
    assert torch.equal(patches.cpu(), patches_by_loop(inputs, conv))


def test_patches_times_the_weight_are_the_convolution(case):
    conv, inputs = case
    patches = patches_of(conv, inputs)
    output = patches @ conv.weight.flatten(1).T + conv.bias
    expected = conv(inputs).flatten(2).transpose(1, 2)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-12)


ONE_DIMENSIONAL = [name for name in CONVOLUTIONS if name.startswith("conv1d")]


@pytest.mark.parametrize("name", ONE_DIMENSIONAL, ids=ONE_DIMENSIONAL)
def test_views_equal_torch_unfold_on_a_flat_image(name):
    """1-D patches by views equal 2-D ones by torch's im2col on ``[N, C, 1, L]``."""
    conv = CONVOLUTIONS[name].double()
    inputs = torch.randn(
        3,
        conv.in_channels,
        *SPATIAL[1],
        generator=torch.Generator().manual_seed(1),
        dtype=torch.float64,
    )
    flat_image = conv_patches(
        inputs.unsqueeze(2),
        (1, *conv.kernel_size),
        stride=(1, *conv.stride),
        padding=(0, *conv.padding),
        dilation=(1, *conv.dilation),
    )
    assert torch.equal(patches_of(conv, inputs), flat_image)


def test_mismatched_arguments_are_refused():
    with pytest.raises(ValueError, match="a 1-d input needs 1 kernel sizes"):
        conv_patches(
            torch.zeros(1, 1, 5), (3, 3), stride=(1,), padding=(0,), dilation=(1,)
        )


def test_memory_layout_does_not_matter(case):
    conv, inputs = case
    strided = inputs.transpose(0, -1).contiguous().transpose(0, -1)  # other strides
    assert not strided.is_contiguous()
    assert torch.equal(patches_of(conv, strided), patches_of(conv, inputs))
