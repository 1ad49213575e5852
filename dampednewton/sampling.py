"""Monte-Carlo samples of a loss Hessian's square root (pure tensor math)."""

from __future__ import annotations

import torch
from torch import Generator, Tensor
from torch.nn.functional import one_hot


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
    labels = torch.multinomial(
        classes_last.reshape(-1, num_classes),
        mc_samples,
        replacement=True,
        generator=generator,
    )
    drawn = one_hot(labels.T, num_classes).to(probs.dtype)
    drawn = drawn.reshape(mc_samples, *classes_last.shape).movedim(-1, 2)
    return probs.unsqueeze(0) - drawn
