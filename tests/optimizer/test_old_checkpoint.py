"""A checkpoint saved before the package's restructuring (issue 26) still loads.

``tests/data/checkpoint_before_issue_26.pt`` was written by the code of the flat
layout (``dampednewton/options.py``, ``group_step.py``, … beside the optimizer): the
model's and the optimizer's ``state_dict`` after :data:`STEPS_BEFORE` steps of
:func:`build`, and the model's ``state_dict`` after one more step. Its pickles name the
classes by module path (policies in ``dampednewton.policies.*``,
``CurvatureAveraging`` in ``dampednewton.averaging``), so moving them would break it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from backpack import extend

from dampednewton import CurvatureAveraging, DampedNewton, LevenbergMarquardt
from tests.utils import make_closure

CHECKPOINT = Path(__file__).parents[1] / "data" / "checkpoint_before_issue_26.pt"
STEPS_BEFORE = 3


def build() -> tuple[torch.nn.Module, DampedNewton, Callable[[], torch.Tensor]]:
    """A tiny float64 MLP with Levenberg-Marquardt damping and curvature averaging."""
    generator = torch.Generator().manual_seed(0)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
        ).double()
    )
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    X = torch.randn(6, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 2, (6,), generator=generator)
    optimizer = DampedNewton(
        model.parameters(),
        lr=0.5,
        damping=LevenbergMarquardt(value=1.0, interval=1),
        criterion=2,
        averaging=CurvatureAveraging(decay=0.5, interval=2),
        seed=0,
    )
    return model, optimizer, make_closure(optimizer, model, loss_fn, X, y)


def test_checkpoint_before_the_restructuring_loads_and_steps_the_same():
    """``weights_only=True`` loads it; a fresh optimizer resumes to the same step."""
    saved = torch.load(CHECKPOINT, weights_only=True)
    model, optimizer, closure = build()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    group = optimizer.param_groups[0]
    assert isinstance(group["damping"], LevenbergMarquardt)
    assert group["damping"].updates == 2  # its saved state, not the defaults
    assert group["averaging"] == CurvatureAveraging(decay=0.5, interval=2)

    optimizer.step(closure)

    for name, value in model.state_dict().items():
        torch.testing.assert_close(
            value, saved["model_after_next_step"][name], rtol=1e-12, atol=1e-14
        )
