r"""The parameter update of one step, given its direction (a functional kernel).

With the trust-region scaled direction ``νs``, momentum ``μ`` and decoupled weight
decay ``wd``:

.. math::

    m \leftarrow \mu m + \nu s, \quad
    \theta \leftarrow (1 - \mathrm{lr}\cdot\mathrm{wd})\,\theta + \mathrm{lr}\cdot m

(Nesterov: ``θ += lr·(νs + μm)``; without momentum ``m = νs`` and no buffer is kept).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dampednewton.options import GroupOptions

MOMENTUM = "momentum_buffer"


def update_parameter(
    param: Tensor, direction: Tensor, state: dict[str, Any], options: GroupOptions
) -> None:
    """Move one parameter in place (call under ``torch.no_grad()``).

    Args:
        param: The parameter.
        direction: Its scaled direction ``νs`` (any floating dtype).
        state: The parameter's optimizer state (holds the momentum buffer).
        options: The group's options (``lr``, ``momentum``, ``nesterov``,
            ``weight_decay``).
    """
    update = direction.to(param.dtype)
    mu = options.momentum
    if mu > 0:
        buffer = state.get(MOMENTUM)
        if buffer is None:
            buffer = state[MOMENTUM] = update.clone()
        else:
            buffer.mul_(mu).add_(update)
        update = update.add(buffer, alpha=mu) if options.nesterov else buffer
    if options.weight_decay > 0:
        param.mul_(1 - options.lr * options.weight_decay)
    param.add_(update, alpha=options.lr)
