"""Muon as a benchmark optimizer: hidden weights orthogonalized, the rest AdamW.

``pytorch_optimizer.Muon`` needs parameter groups flagged ``use_muon``: Muon's
Newton–Schulz update is meant for the hidden weight matrices only, AdamW for the
read-out layer, biases and gains. The benchmark runner calls an optimizer factory
with the trainable parameters in the model's order (``model.parameters()`` of an
``nn.Sequential``), so the read-out is the last parameter with two or more
dimensions; :func:`muon` splits the parameters on that rule. Convolution filters
count as hidden weights, orthogonalized as their ``[out, in·kernel]`` matrix (Muon's
own treatment of convolutions).

One learning rate drives both groups (Moonlight's recipe, ``use_adjusted_lr``: the
Muon update is scaled by ``0.2·√max(rows, columns)`` to the RMS of an AdamW update),
so a sweep tunes one number, as for every other optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pytorch_optimizer import Muon


def split_hidden_weights(
    params: Sequence[torch.nn.Parameter],
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Hidden weights (Muon's) and the rest (AdamW's) of parameters in model order.

    Args:
        params: Trainable parameters in the order of the model's forward pass.

    Returns:
        The hidden weights (every parameter with two or more dimensions but the
        last one, the read-out) and the other parameters, each in the given order.

    Raises:
        ValueError: If there is no hidden weight (fewer than two parameters with two
            or more dimensions): Muon would be plain AdamW there.
    """
    params = list(params)
    matrices = [i for i, p in enumerate(params) if p.ndim >= 2]
    if len(matrices) < 2:
        raise ValueError(
            f"Muon needs a hidden weight matrix, but the model has {len(matrices)} "
            "parameter(s) with two or more dimensions (the last one is the read-out, "
            "which Muon leaves to AdamW): use optimizer=adam on this problem."
        )
    hidden = set(matrices[:-1])
    return (
        [p for i, p in enumerate(params) if i in hidden],
        [p for i, p in enumerate(params) if i not in hidden],
    )


def muon(
    params: Sequence[torch.nn.Parameter],
    lr: float = 0.001,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adamw_betas: Sequence[float] = (0.9, 0.95),
    weight_decay: float = 0.0,
) -> Muon:
    """``pytorch_optimizer.Muon`` on the hidden weights, its AdamW on the rest.

    Args:
        params: Trainable parameters in the order of the model's forward pass.
        lr: Learning rate of both groups (the Muon group's scaled by Moonlight's
            shape factor).
        momentum: Muon's momentum.
        nesterov: Nesterov momentum for the Muon group.
        ns_steps: Newton–Schulz iterations.
        adamw_betas: AdamW's decay rates of the first and second moments.
        weight_decay: Decoupled weight decay of both groups.

    Returns:
        The optimizer.
    """
    hidden, rest = split_hidden_weights(params)
    beta1, beta2 = adamw_betas
    groups = [
        {"params": hidden, "use_muon": True},
        {"params": rest, "use_muon": False},
    ]
    return Muon(
        groups,
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        use_adjusted_lr=True,
        adamw_lr=lr,
        adamw_betas=(beta1, beta2),
        weight_decay=weight_decay,
        adamw_wd=weight_decay,
    )
