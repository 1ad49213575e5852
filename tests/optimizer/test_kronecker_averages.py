"""The Kronecker basis' averaged factors against the batch's explicit factors.

The first layer's input factor ``A = (1/N) X̃ᵀX̃`` (inputs with a column of ones for
the bias) depends on the data only: on one fixed batch every refresh sees the same
``A``, so any correctly bias-corrected average is ``A`` itself, whatever refreshes the
layer missed. Without averaging, a refresh's factors are the batch's own, so every
refresh decomposes them anew.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from backpack import extend
from torch import Tensor, nn

from dampednewton import DampedNewton, KroneckerBasis
from dampednewton._step.kronecker_state import LAYER_REFRESHES

N, D_IN = 16, 6
EXACT = KroneckerBasis(exact_size=100)  # every factor decomposed exactly


def _problem() -> tuple[nn.Sequential, nn.Module, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(N, D_IN, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=generator)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 5), nn.Tanh(), nn.Linear(5, 3))
    return extend(model.double()), extend(nn.CrossEntropyLoss()), X, y


def _input_factor(X: Tensor) -> Tensor:
    """The brute-force ``A`` of the first layer: ``(1/N) X̃ᵀX̃``."""
    inputs = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], dim=1)
    return inputs.T @ inputs / X.shape[0]


def _closure(
    optimizer: DampedNewton, model: nn.Sequential, loss_fn, X, y, detached=False
) -> Callable[[], Tensor]:
    def closure() -> Tensor:
        optimizer.zero_grad()
        hidden = model[0](X)
        if detached:  # the first layer unused by this step (no gradient)
            hidden = hidden.detach()
        loss = loss_fn(model[2](model[1](hidden)), y)
        loss.backward()
        return loss

    return closure


def _input_eigenvalues(optimizer: DampedNewton, layer: nn.Linear) -> Tensor:
    return optimizer.state[layer.weight]["kronecker_input_values"].sort().values


def test_a_layer_unused_at_refreshes_keeps_its_average_and_its_weights():
    """Unused at the refreshes of steps 1 and 3, used again at 7.

    Its average holds its own two refreshes, corrected by their weights, not by the
    group's four.
    """
    model, loss_fn, X, y = _problem()
    optimizer = DampedNewton(model.parameters(), mc_samples=0, basis=EXACT)
    for step in range(8):  # refreshes at steps 0, 1, 3, 7
        unused = 1 <= step <= 6
        optimizer.step(_closure(optimizer, model, loss_fn, X, y, detached=unused))
        if step == 3:
            assert optimizer.records["groups"][0][LAYER_REFRESHES] == (1, 3)
    assert optimizer.records["groups"][0][LAYER_REFRESHES] == (2, 4)
    expected = torch.linalg.eigvalsh(_input_factor(X))
    torch.testing.assert_close(
        _input_eigenvalues(optimizer, model[0]), expected, rtol=1e-12, atol=1e-14
    )


def test_a_layer_frozen_at_a_refresh_starts_its_average_afresh():
    """Frozen over the refresh of step 3, unfrozen before step 7: it restarts there."""
    model, loss_fn, X, y = _problem()
    optimizer = DampedNewton(model.parameters(), mc_samples=0, basis=EXACT)
    closure = _closure(optimizer, model, loss_fn, X, y)
    for step in range(8):
        model[0].requires_grad_(not 2 <= step <= 5)
        optimizer.step(closure)
        if step == 3:
            assert optimizer.records["groups"][0]["kronecker_layers"] == ((2, 3),)
    assert optimizer.records["groups"][0][LAYER_REFRESHES] == (1, 4)
    expected = torch.linalg.eigvalsh(_input_factor(X))
    torch.testing.assert_close(
        _input_eigenvalues(optimizer, model[0]), expected, rtol=1e-12, atol=1e-14
    )


def test_without_averaging_every_refresh_decomposes_the_batch_factors():
    """A new batch each step, averaging off: each step's ``A`` is its batch's.

    Also on steps 5–8 (with averaging, Rayleigh quotients along stored eigenvectors
    on two refreshes of three from the sixth on).
    """
    model, loss_fn, _, _ = _problem()
    optimizer = DampedNewton(
        model.parameters(), mc_samples=0, basis=EXACT, averaging=None
    )
    generator = torch.Generator().manual_seed(2)
    for _ in range(9):
        X = torch.randn(N, D_IN, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (N,), generator=generator)
        optimizer.step(_closure(optimizer, model, loss_fn, X, y))
        expected = torch.linalg.eigvalsh(_input_factor(X))
        torch.testing.assert_close(
            _input_eigenvalues(optimizer, model[0]), expected, rtol=1e-12, atol=1e-14
        )
