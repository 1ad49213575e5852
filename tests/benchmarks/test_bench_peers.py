"""Muon's parameter split: hidden weights to Muon, the read-out and biases to AdamW."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from benchmarks.problems.models import conv_2c2d, mlp, mnist1d_cnn, quadratic_model
from benchmarks.problems.peers import muon, split_hidden_weights


def _generator():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    "build",
    [
        lambda: mlp(40, [100, 100], 10, generator=_generator()),
        lambda: mnist1d_cnn(generator=_generator()),
        lambda: conv_2c2d(generator=_generator()),
    ],
    ids=["mlp", "mnist1d_cnn", "2c2d"],
)
def test_hidden_weights_are_every_weight_but_the_read_out(build):
    model = build()
    hidden, rest = split_hidden_weights(list(model.parameters()))
    modules = [
        m
        for m in model
        if isinstance(m, torch.nn.Linear | torch.nn.Conv1d | torch.nn.Conv2d)
    ]
    *body, read_out = modules
    assert [id(p) for p in hidden] == [id(m.weight) for m in body]
    expected_rest = [id(m.bias) for m in body] + [
        id(read_out.weight),
        id(read_out.bias),
    ]
    assert sorted(id(p) for p in rest) == sorted(expected_rest)


def test_a_model_without_hidden_weight_is_a_clear_error():
    model = quadratic_model(np.eye(3), generator=_generator())
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match="use optimizer=adam"):
        split_hidden_weights(params)


def test_read_out_takes_adamws_first_step_and_hidden_weights_muons():
    model = mlp(4, [6], 3, activation="tanh", generator=_generator()).double()
    x = torch.randn(8, 4, generator=_generator(), dtype=torch.float64)
    y = torch.arange(8) % 3
    torch.nn.functional.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer = muon(list(model.parameters()), lr=0.01)
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, False]
    assert all(g["lr"] == 0.01 for g in optimizer.param_groups)
    optimizer.step()
    after = list(model.parameters())
    eps = optimizer.param_groups[1]["eps"]

    def adamw_first_step(index):  # bias-corrected moments of one gradient: g / |g|
        grad = grads[index]
        return before[index] - 0.01 * grad / (grad.abs() + eps)

    for index in (1, 2, 3):  # hidden bias, read-out weight and bias
        torch.testing.assert_close(after[index], adamw_first_step(index))
    assert not torch.allclose(after[0], adamw_first_step(0)), "Muon's, not AdamW's"
    assert not torch.equal(after[0], before[0])


def test_pytorch_optimizer_imports_without_torchvision():
    # PyPI's torchvision wheel does not import against a CPU torch: the peers must not
    # need it.
    code = (
        "import sys, pytorch_optimizer; "
        "from pytorch_optimizer import SOAP, Kron, Muon; "
        "assert 'torchvision' not in sys.modules, 'imported torchvision'"
    )
    process = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 0, process.stderr


def test_einsum_plans_its_contractions_for_kron():
    # Without opt_einsum, torch.einsum contracts left to right: Kron's five-operand
    # preconditioner product took 9 s a step on the MNIST-1D MLP instead of 9 ms.
    assert torch.backends.opt_einsum.is_available()
    assert torch.backends.opt_einsum.enabled
