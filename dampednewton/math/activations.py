r"""First and second derivatives of element-wise activations BackPACK lacks.

Each function returns ``(f'(x), f''(x))`` element-wise, in ``x``'s dtype, with the
same branch conventions as torch's autograd (so a step back-propagates what
``loss.backward()`` does):

* GELU, exact: ``f = x Φ(x)``, ``f' = Φ(x) + x φ(x)``, ``f'' = φ(x)(2 − x²)``;
* GELU, tanh approximation: ``f = ½ x (1 + t)``, ``t = tanh(u)``,
  ``u = c (x + k x³)``, ``c = √(2/π)``, ``k = 0.044715``:
  ``f' = ½ (1 + t) + ½ x (1 − t²) u'`` and
  ``f'' = (1 − t²) (u' + ½ x (u'' − 2 t u'²))``;
* SiLU: ``f = x s``, ``s = σ(x)``: ``f' = s (1 + x (1 − s))``,
  ``f'' = s (1 − s) (2 + x (1 − 2 s))``;
* Softplus: ``f = log(1 + e^{βx}) / β``, linear where ``βx > threshold``:
  ``f' = σ(βx)``, ``f'' = β σ(βx) (1 − σ(βx))`` (``1`` and ``0`` where linear);
* Mish: ``f = x g``, ``g = tanh(softplus(x))``, ``s = σ(x)``:
  ``f' = g + x (1 − g²) s``, ``f'' = (1 − g²) s (2 + x (1 − s − 2 g s))``;
* Hardswish: ``f = x · min(max(x + 3, 0), 6) / 6``: ``f' = 0`` up to ``−3``,
  ``x/3 + ½`` strictly between ``−3`` and ``3``, ``1`` from ``3``; ``f'' = ⅓``
  strictly between, else ``0``.

The GGN needs the first derivatives only (the activation's Jacobian); the Hessian's
diagonal (``DiagHessian``, the curvature traces) needs the second too.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

GELU_TANH_CUBIC = 0.044715
"""The cubic coefficient ``k`` of GELU's tanh approximation."""


def gelu(x: Tensor, approximate: str = "none") -> tuple[Tensor, Tensor]:
    """``f'`` and ``f''`` of ``torch.nn.GELU(approximate)`` at ``x``.

    Args:
        x: The activation's input.
        approximate: ``"none"`` (exact, the normal CDF) or ``"tanh"``.

    Returns:
        ``(f'(x), f''(x))``.

    Raises:
        ValueError: For another ``approximate``.
    """
    if approximate == "none":
        density = torch.exp(-0.5 * x.square()) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        return cdf + x * density, density * (2 - x.square())
    if approximate == "tanh":
        scale = math.sqrt(2 / math.pi)
        t = torch.tanh(scale * (x + GELU_TANH_CUBIC * x.pow(3)))
        slope = scale * (1 + 3 * GELU_TANH_CUBIC * x.square())  # u'
        bend = 6 * scale * GELU_TANH_CUBIC * x  # u''
        sech2 = 1 - t.square()
        first = 0.5 * (1 + t) + 0.5 * x * sech2 * slope
        second = sech2 * (slope + 0.5 * x * (bend - 2 * t * slope.square()))
        return first, second
    raise ValueError(f"GELU's approximate is 'none' or 'tanh', got {approximate!r}.")


def silu(x: Tensor) -> tuple[Tensor, Tensor]:
    """``f'`` and ``f''`` of ``torch.nn.SiLU`` (swish) at ``x``."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s)), s * (1 - s) * (2 + x * (1 - 2 * s))


def softplus(
    x: Tensor, beta: float = 1.0, threshold: float = 20.0
) -> tuple[Tensor, Tensor]:
    """``f'`` and ``f''`` of ``torch.nn.Softplus(beta, threshold)`` at ``x``.

    Args:
        x: The activation's input.
        beta: ``β``.
        threshold: Where ``βx`` exceeds it, the function is ``x``.

    Returns:
        ``(f'(x), f''(x))``.
    """
    s = torch.sigmoid(beta * x)
    linear = beta * x > threshold
    first = torch.where(linear, torch.ones_like(x), s)
    second = torch.where(linear, torch.zeros_like(x), beta * s * (1 - s))
    return first, second


def mish(x: Tensor) -> tuple[Tensor, Tensor]:
    """``f'`` and ``f''`` of ``torch.nn.Mish`` at ``x``."""
    g = torch.tanh(torch.nn.functional.softplus(x))
    s = torch.sigmoid(x)
    sech2 = 1 - g.square()
    return g + x * sech2 * s, sech2 * s * (2 + x * (1 - s - 2 * g * s))


def hardswish(x: Tensor) -> tuple[Tensor, Tensor]:
    """``f'`` and ``f''`` of ``torch.nn.Hardswish`` at ``x`` (torch's branches)."""
    middle = (x > -3) & (x < 3)
    first = torch.where(x >= 3, torch.ones_like(x), x / 3 + 0.5)
    first = torch.where(x <= -3, torch.zeros_like(x), first)
    second = torch.where(middle, torch.full_like(x, 1 / 3), torch.zeros_like(x))
    return first, second
