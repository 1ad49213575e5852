"""Numbers quoted in the docs' prose come from rerunning what produces them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dampednewton import DampedNewton, GramBasis
from tests.cases import readme_problem

USAGE = Path(__file__).parents[1] / "docs" / "usage.md"
# ViViT's step: no complement, this batch's exact GGN, no trust region.
VIVIT = {
    "basis": GramBasis(),
    "complement": None,
    "newton_fraction": 1.0,
    "averaging": None,
    "kl_clip": None,
    "mc_samples": 0,
    "damping": 1e-2,
}


def readme_example_loss(**settings) -> float:
    """The loss after the first and 20 more steps of the README's example."""
    model, loss_fn, X, y = readme_problem()
    optimizer = DampedNewton(model.parameters(), **settings)

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        return loss

    for _ in range(21):
        loss = optimizer.step(closure)
    return loss.item()


@pytest.mark.slow
def test_criterion_paragraph_quotes_the_losses_the_example_reaches():
    text = " ".join(USAGE.read_text().split())
    defaults = [
        readme_example_loss(basis=GramBasis(), criterion=k) for k in (3, 10, 30)
    ]
    vivit = [readme_example_loss(criterion=k, **VIVIT) for k in (3, 10, 30)]
    expected = (
        f"`criterion=3` reaches loss {defaults[0]:.3g}, `10` reaches "
        f"{defaults[1]:.3g} and `30` reaches {defaults[2]:.3g} with the Gram basis' "
        "defaults; "
        "ViViT's step (no complement, exact GGN, `damping=1e-2`) reaches "
        f"{vivit[0]:.3g}, {vivit[1]:.3g} and {vivit[2]:.3g}:"
    )
    found = re.search(r"`criterion=3` reaches loss .*?:", text)
    assert found and found.group(0) == expected
