"""``torch.compile`` and BackPACK's hooks: the refusal names the likely cause."""

from __future__ import annotations

import pytest
import torch
from backpack import extend
from packaging.version import Version
from torch import nn

from dampednewton import DampedNewton


class TinyNet(nn.Sequential):
    """A model class of its own, so that no other test compiled it before."""

    def __init__(self):
        super().__init__(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


# TorchDynamo of torch 2.4 keeps the hooks of a model whose class it compiled before
# without them (`make test-floor`); the graph reuse this guards against came with 2.5.
@pytest.mark.skipif(
    Version(torch.__version__).release[:2] < (2, 5),
    reason="torch < 2.5 does not reuse a hook-free graph for the extended model",
)
@pytest.mark.slow
def test_compiled_model_that_skips_backpacks_hooks_is_refused_naming_compile():
    gen = torch.Generator().manual_seed(0)
    X, y = torch.randn(8, 3, generator=gen), torch.tensor([0, 1] * 4)
    plain = torch.compile(TinyNet())
    plain(X).sum().backward()  # compiles TinyNet's forward without hooks
    model = extend(TinyNet())
    compiled = torch.compile(model)
    loss_fn = extend(nn.CrossEntropyLoss())
    optimizer = DampedNewton(model.parameters(), seed=0)
    values = [p.detach().clone() for p in model.parameters()]

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(compiled(X), y)
        loss.backward()
        return loss

    try:
        with pytest.raises(RuntimeError, match=r"torch\.compile'd model can skip"):
            optimizer.step(closure)
    finally:
        torch._dynamo.reset()
    for param, value in zip(model.parameters(), values, strict=True):
        assert torch.equal(param, value)
