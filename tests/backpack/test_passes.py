"""One backward pass for several consumers: chained hooks, freed quantities."""

from __future__ import annotations

import torch
from backpack import extend
from backpack.extensions import BatchGrad, SumGradSquared
from torch import nn

from dampednewton.backpack.passes import backward_pass, chained
from dampednewton.backpack.savefields import GRAD_BATCH, SUM_GRAD_SQUARED


def test_chained_hooks_run_in_order_then_free_the_savefields():
    layer = nn.Linear(2, 1)
    for param in layer.parameters():
        setattr(param, GRAD_BATCH, torch.ones(1))
        param.kept = torch.ones(1)
    seen = []

    def first(module):
        seen.append(("first", hasattr(module.weight, GRAD_BATCH)))

    def second(module):
        seen.append(("second", hasattr(module.weight, GRAD_BATCH)))

    chained([first, None, second], [GRAD_BATCH, SUM_GRAD_SQUARED])(layer)
    assert seen == [("first", True), ("second", True)]
    for param in layer.parameters():
        assert not hasattr(param, GRAD_BATCH)
        assert hasattr(param, "kept")


def test_backward_pass_frees_every_quantity_after_the_hooks():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    loss_fn = extend(nn.CrossEntropyLoss())
    reached = []

    def hook(module):
        for param in module.parameters(recurse=False):
            reached.append(
                (getattr(param, GRAD_BATCH).shape[0], hasattr(param, SUM_GRAD_SQUARED))
            )

    loss = loss_fn(model(torch.randn(5, 3)), torch.tensor([0, 1, 0, 1, 1]))
    with backward_pass([BatchGrad(), SumGradSquared()], [hook]):
        loss.backward()
    assert reached == [(5, True)] * 4
    for param in model.parameters():
        assert not hasattr(param, GRAD_BATCH)
        assert not hasattr(param, SUM_GRAD_SQUARED)
