"""Monte-Carlo samples of a loss Hessian's square root (pure tensor math)."""

from __future__ import annotations

import torch
from torch import Generator, Tensor


def sampled_cross_entropy_gradients(
    logits: Tensor, mc_samples: int, generator: Generator | None = None
) -> Tensor:
    """Gradients of the cross-entropy at labels drawn from the model's own softmax.

    With ``p = softmax(f)`` and ``ŷ ~ Cat(p)``, the gradient of ``−log p_ŷ`` w.r.t.
    ``f`` is ``p − onehot(ŷ)``; its outer product has expectation ``diag(p) − ppᵀ``,
    the Hessian of the cross-entropy. So ``M`` draws divided by ``√M`` are a
    Monte-Carlo square root of that Hessian.

    Args:
        logits: Model outputs ``[N, C, *D]`` (classes in dimension 1).
        mc_samples: Number of draws ``M`` per sample (and position).
        generator: Random source, ``None`` for the global random state.

    Returns:
        ``[M, N, C, *D]`` gradients (not yet divided by ``√M``).
    """
    probs = logits.softmax(dim=1)
    num_classes = probs.shape[1]
    classes_last = probs.movedim(1, -1)
    labels = _inverse_cdf_draws(
        classes_last.reshape(-1, num_classes), mc_samples, generator
    )
    drawn = torch.zeros(
        mc_samples, labels.shape[0], num_classes, dtype=probs.dtype, device=probs.device
    ).scatter_(-1, labels.T.unsqueeze(-1), 1.0)
    drawn = drawn.reshape(mc_samples, *classes_last.shape).movedim(-1, 2)
    return probs.unsqueeze(0) - drawn


def _inverse_cdf_draws(
    probs: Tensor, num_draws: int, generator: Generator | None
) -> Tensor:
    """Class indices ``[R, num_draws]`` drawn from each row of ``probs`` ``[R, C]``.

    Inverse transform sampling: the first class whose cumulative probability exceeds
    a uniform draw on ``[0, total)`` (several times faster than ``torch.multinomial``
    for few classes on CPU).
    """
    cdf = probs.cumsum(dim=-1)
    uniform = torch.rand(
        probs.shape[0],
        num_draws,
        generator=generator,
        dtype=probs.dtype,
        device=probs.device,
    )
    labels = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)
    return labels.clamp_max(probs.shape[1] - 1)
