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
    probs = logits.detach().softmax(dim=1)
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


def sampled_binary_cross_entropy_gradients(
    logits: Tensor, mc_samples: int, generator: Generator | None = None
) -> Tensor:
    """Gradients of the binary cross-entropy at labels drawn from the model's sigmoid.

    With ``p = σ(f)`` and ``ŷ ~ Bernoulli(p)`` drawn for each output independently,
    the gradient of ``BCEWithLogits(f, ŷ)`` w.r.t. ``f`` is ``p − ŷ``; its outer
    product has expectation ``diag(p (1 − p))``, the Hessian (diagonal for several
    outputs, as their losses are summed). So ``M`` draws divided by ``√M`` are a
    Monte-Carlo square root of that Hessian. Uniform draws compared with ``p`` work
    in every floating dtype (``torch.binomial`` has no half-precision CPU kernel).

    Args:
        logits: Model outputs ``[N, C]``.
        mc_samples: Number of draws ``M`` per output.
        generator: Random source, ``None`` for the global random state.

    Returns:
        ``[M, N, C]`` gradients (not yet divided by ``√M``).
    """
    logits = logits.detach()
    # Half precisions resolve probabilities to 2⁻⁸ or 2⁻¹¹: draw in float32.
    probs = (logits.float() if logits.element_size() < 4 else logits).sigmoid()
    uniform = torch.rand(
        mc_samples,
        *probs.shape,
        generator=generator,
        dtype=probs.dtype,
        device=probs.device,
    )
    return (probs.unsqueeze(0) - (uniform < probs).to(probs.dtype)).to(logits.dtype)


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
