"""Brute-force float64 references for the GGN, its eigenpairs and the damped step.

Only plain autograd and ``torch.func`` on ordinary (non-BackPACK) models are used.

Conventions:
    * The loss uses ``reduction="mean"``: ``L = (1/N) Σ_n ℓ_n`` with the per-sample
      loss ``ℓ_n(f_n) = loss_fn(f_n.unsqueeze(0), y_n.unsqueeze(0))`` (same module).
      For ``MSELoss`` this is ``(1/C)·||f_n − y_n||²``.
    * A parameter group is a list of the model's parameters; vectors over the group
      are the concatenation of ``p.flatten()`` in list order (length D).
    * ``J_n = ∂f_n/∂θ_group`` (C×D), ``H_n = ∇²_f ℓ_n`` (C×C),
      ``G_n = J_nᵀ H_n J_n`` and ``G_S = (1/|S|) Σ_{n∈S} G_n``.
    * Eigenvalues are ascending, eigenvectors are columns (``torch.linalg.eigh``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate tensors, each flattened, into one vector.

    Args:
        tensors: Tensors in parameter-group order.

    Returns:
        Vector of length ``Σ t.numel()``.

    Raises:
        ValueError: If ``tensors`` is empty.
    """
    if len(tensors) == 0:
        raise ValueError("Cannot flatten an empty list of tensors.")
    return torch.cat([t.flatten() for t in tensors])


def unflatten(vec: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """Split a vector into tensors shaped like ``params`` (inverse of ``flatten``).

    Args:
        vec: Vector of length ``Σ p.numel()``.
        params: Tensors whose shapes define the split.

    Returns:
        Views of ``vec``, one per entry of ``params``, with the same shapes.

    Raises:
        ValueError: If ``vec`` is not a vector of the right length.
    """
    sizes = [p.numel() for p in params]
    if vec.dim() != 1 or vec.numel() != sum(sizes):
        raise ValueError(
            f"Expected a vector of length {sum(sizes)} (the group's parameter "
            f"count), got shape {tuple(vec.shape)}."
        )
    return [
        chunk.view(p.shape)
        for chunk, p in zip(torch.split(vec, sizes), params, strict=True)
    ]


def per_sample_loss(loss_fn: nn.Module, output: Tensor, target: Tensor) -> Tensor:
    """Loss of one sample, ``ℓ_n(f_n) = loss_fn(f_n.unsqueeze(0), y_n.unsqueeze(0))``.

    Args:
        loss_fn: Loss module with ``reduction="mean"``.
        output: Model output of one sample, shape ``[C]``.
        target: Target of that sample (``[]`` class index or ``[C]`` values).

    Returns:
        Scalar loss.
    """
    return loss_fn(output.unsqueeze(0), target.unsqueeze(0))


def per_sample_losses(loss_fn: nn.Module, outputs: Tensor, targets: Tensor) -> Tensor:
    """Losses ``ℓ_n`` of all samples; their mean is ``loss_fn(outputs, targets)``.

    Args:
        loss_fn: Loss module with ``reduction="mean"``.
        outputs: Model outputs, shape ``[N, C]``.
        targets: Targets, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N]``.
    """
    _check_outputs(outputs, targets)
    return torch.stack(
        [per_sample_loss(loss_fn, f, y) for f, y in zip(outputs, targets, strict=True)]
    )


def output_jacobians(model: nn.Module, params: Sequence[Tensor], X: Tensor) -> Tensor:
    """Jacobians ``J_n = ∂f_n/∂θ`` of the outputs w.r.t. a parameter group.

    Parameters outside the group are held fixed.

    Args:
        model: Model mapping ``X`` to outputs of shape ``[N, C]``.
        params: Parameter group (parameters of ``model``, no duplicates).
        X: Inputs, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N, C, D]``.

    Raises:
        ValueError: If the outputs are not of shape ``[N, C]``.
    """
    names = _parameter_names(model, params)

    def outputs_of(theta: Tensor) -> Tensor:
        overrides = dict(zip(names, unflatten(theta, params), strict=True))
        return functional_call(model, overrides, (X.detach(),))

    theta = flatten([p.detach() for p in params])
    jacobians = jacrev(outputs_of)(theta).detach()
    if jacobians.dim() != 3 or jacobians.shape[0] != X.shape[0]:
        raise ValueError(
            "Model outputs must have shape [N, C]; got Jacobian of shape "
            f"{tuple(jacobians.shape)} for {X.shape[0]} samples."
        )
    return jacobians


def loss_hessians(loss_fn: nn.Module, outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample loss Hessians ``H_n = ∇²_f ℓ_n`` w.r.t. the model output.

    Args:
        loss_fn: Loss module with ``reduction="mean"``.
        outputs: Model outputs, shape ``[N, C]``.
        targets: Targets, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N, C, C]``.
    """
    _check_outputs(outputs, targets)
    hessians = []
    for f, y in zip(outputs.detach(), targets, strict=True):

        def loss_of(output: Tensor, target: Tensor = y) -> Tensor:
            return per_sample_loss(loss_fn, output, target)

        hessians.append(torch.autograd.functional.hessian(loss_of, f))
    return torch.stack(hessians)


def per_sample_ggns(
    model: nn.Module,
    loss_fn: nn.Module,
    params: Sequence[Tensor],
    X: Tensor,
    y: Tensor,
) -> Tensor:
    """Per-sample GGNs ``G_n = J_nᵀ H_n J_n`` of a parameter group.

    Args:
        model: Model mapping ``X`` to outputs of shape ``[N, C]``.
        loss_fn: Loss module with ``reduction="mean"``.
        params: Parameter group.
        X: Inputs, leading dimension ``N``.
        y: Targets, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N, D, D]``.
    """
    jacobians = output_jacobians(model, params, X)
    with torch.no_grad():
        hessians = loss_hessians(loss_fn, model(X), y)
    return torch.einsum("ncd,nce,nef->ndf", jacobians, hessians, jacobians)


def ggn(
    model: nn.Module,
    loss_fn: nn.Module,
    params: Sequence[Tensor],
    X: Tensor,
    y: Tensor,
    subsampling: list[int] | None = None,
) -> Tensor:
    """GGN block ``G_S = (1/|S|) Σ_{n∈S} G_n`` of a parameter group.

    Args:
        model: Model mapping ``X`` to outputs of shape ``[N, C]``.
        loss_fn: Loss module with ``reduction="mean"``.
        params: Parameter group.
        X: Inputs, leading dimension ``N``.
        y: Targets, leading dimension ``N``.
        subsampling: Sample indices ``S`` (repeated indices count repeatedly);
            ``None`` uses all samples.

    Returns:
        Tensor of shape ``[D, D]``.
    """
    indices = _check_subsampling(subsampling, X.shape[0])
    return per_sample_ggns(model, loss_fn, params, X, y)[indices].mean(0)


def per_sample_gradients(
    model: nn.Module,
    loss_fn: nn.Module,
    params: Sequence[Tensor],
    X: Tensor,
    y: Tensor,
) -> Tensor:
    """Per-sample gradients ``∇_θ ℓ_n``, one forward-backward pass per sample.

    Note the scale: their mean is the gradient of the mean loss (BackPACK's
    ``BatchGrad`` stores ``∇ℓ_n / N`` instead).

    Args:
        model: Model mapping ``X`` to outputs of shape ``[N, C]``.
        loss_fn: Loss module with ``reduction="mean"``.
        params: Parameter group.
        X: Inputs, leading dimension ``N``.
        y: Targets, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N, D]``.
    """
    _parameter_names(model, params)
    gradients = []
    for n in range(X.shape[0]):
        outputs = model(X[n : n + 1])
        _check_outputs(outputs, y[n : n + 1])
        loss = per_sample_loss(loss_fn, outputs[0], y[n])
        gradients.append(flatten(torch.autograd.grad(loss, list(params))))
    return torch.stack(gradients)


def ggn_eigenpairs(G: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition of a symmetric GGN block.

    Args:
        G: Symmetric matrix of shape ``[D, D]``.

    Returns:
        Eigenvalues ``[D]`` in ascending order and orthonormal eigenvectors
        ``[D, D]`` as columns (``G @ evecs[:, k] = evals[k] * evecs[:, k]``).
    """
    _check_symmetric(G, "G")
    return torch.linalg.eigh(G)


def directional_derivatives(
    G_sub: Tensor, Gn: Tensor, grads: Tensor, k: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """First/second-order directional derivatives along the top-k GGN eigenvectors.

    Directions ``e_j`` are the eigenvectors of the ``k`` largest eigenvalues of
    ``G_sub``, kept in ascending order (the last ``k`` columns of ``eigh``).
    Eigenvectors are defined up to sign (γ flips with it, λ does not), and only up
    to rotation within repeated eigenvalues.

    Args:
        G_sub: GGN of the curvature samples, shape ``[D, D]``.
        Gn: Per-sample GGNs, shape ``[N_ggn, D, D]``. If they are the GGNs of the
            samples that built ``G_sub``, ``lambdas.mean(0) == evals``.
        grads: Per-sample gradients ``∇ℓ_n`` (not divided by N), shape
            ``[N_grad, D]``.
        k: Number of directions, ``1 ≤ k ≤ D``.

    Returns:
        ``(gammas, lambdas, evals, evecs)`` with ``gammas [N_grad, k]``
        (``gammas[n, j] = grads[n] · e_j``), ``lambdas [N_ggn, k]``
        (``lambdas[n, j] = e_jᵀ Gn[n] e_j``), ``evals [k]`` and ``evecs [D, k]``.

    Raises:
        ValueError: If shapes are inconsistent or ``k`` is out of range.
    """
    dim = G_sub.shape[0]
    if Gn.dim() != 3 or Gn.shape[1:] != (dim, dim):
        raise ValueError(
            f"Gn must have shape [N, {dim}, {dim}], got {tuple(Gn.shape)}."
        )
    if grads.dim() != 2 or grads.shape[1] != dim:
        raise ValueError(f"grads must have shape [N, {dim}], got {tuple(grads.shape)}.")
    if not 1 <= k <= dim:
        raise ValueError(f"k must lie in [1, {dim}], got {k}.")
    evals, evecs = ggn_eigenpairs(G_sub)
    evals, evecs = evals[-k:], evecs[:, -k:]
    gammas = grads @ evecs
    lambdas = torch.einsum("dj,nde,ej->nj", evecs, Gn, evecs)
    return gammas, lambdas, evals, evecs


def damped_newton_step(
    G_sub: Tensor, Gn: Tensor, grads: Tensor, k: int, damping: Tensor
) -> Tensor:
    """Directionally damped Newton step ``Σ_j −mean_n(γ_nj)/(mean_n(λ_nj)+δ_j) e_j``.

    With ``k = D`` and constant damping δ, and ``Gn`` the GGNs of the samples of
    ``G_sub``, this is ``−(G_sub + δI)⁻¹ ḡ``.

    Args:
        G_sub: GGN of the curvature samples, shape ``[D, D]``.
        Gn: Per-sample GGNs of the curvature samples, shape ``[N_ggn, D, D]``.
        grads: Per-sample gradients of the gradient samples, shape ``[N_grad, D]``.
        k: Number of top eigen-directions, ``1 ≤ k ≤ D``.
        damping: Damping δ per direction, shape ``[k]``, in the ascending order of
            the directions.

    Returns:
        Step of shape ``[D]``.

    Raises:
        ValueError: If ``damping`` has the wrong shape or a denominator vanishes.
    """
    gammas, lambdas, _, evecs = directional_derivatives(G_sub, Gn, grads, k)
    if damping.shape != (k,):
        raise ValueError(f"damping must have shape [{k}], got {tuple(damping.shape)}.")
    denominators = lambdas.mean(0) + damping
    if (denominators == 0).any():
        raise ValueError(
            "A direction has zero curvature plus damping; add damping or select "
            "fewer directions."
        )
    return evecs @ (-gammas.mean(0) / denominators)


def hessian_diagonal(
    model: nn.Module, loss_fn: nn.Module, params: list[Tensor], X: Tensor, y: Tensor
) -> Tensor:
    """Diagonal of the mean loss's full Hessian (an autograd loop over its rows).

    Returns:
        Vector over the concatenated ``params``.
    """
    names = _parameter_names(model, params)

    def loss_of(theta: Tensor) -> Tensor:
        overrides = dict(zip(names, unflatten(theta, params), strict=True))
        return loss_fn(functional_call(model, overrides, (X,)), y)

    theta = flatten([p.detach() for p in params])
    return torch.diagonal(torch.autograd.functional.hessian(loss_of, theta)).detach()


def ggn_diagonal(
    model: nn.Module, loss_fn: nn.Module, params: list[Tensor], X: Tensor, y: Tensor
) -> Tensor:
    """Diagonal of the GGN ``(1/N) Σ_n J_nᵀ H_n J_n`` from explicit Jacobians.

    Returns:
        Vector over the concatenated ``params``.
    """
    return torch.diagonal(ggn(model, loss_fn, params, X, y))


def match_spectra(gram_evals: Tensor, ggn_evals: Tensor) -> tuple[Tensor, Tensor]:
    """Comparable parts of the Gram and the GGN spectrum.

    ``Ĝ = VᵀV`` ((N·C)×(N·C)) and ``G = VVᵀ`` (D×D) share their non-zero
    eigenvalues; the remaining ones are zero. Hence the largest ``min(D, N·C)``
    eigenvalues of both agree; the others are checked with ``extra_eigenvalues``.

    Args:
        gram_evals: Gram eigenvalues, ascending, shape ``[N·C]``.
        ggn_evals: GGN eigenvalues, ascending, shape ``[D]``.

    Returns:
        The largest ``min(D, N·C)`` eigenvalues of each, ascending.
    """
    common = min(_check_ascending(gram_evals), _check_ascending(ggn_evals))
    return gram_evals[-common:], ggn_evals[-common:]


def extra_eigenvalues(gram_evals: Tensor, ggn_evals: Tensor) -> Tensor:
    """Eigenvalues of the longer spectrum that ``match_spectra`` leaves out.

    These are the smallest ``|N·C − D|`` eigenvalues of the Gram matrix (if
    ``N·C > D``) or of the GGN (if ``D > N·C``); all of them must be zero up to
    round-off.

    Args:
        gram_evals: Gram eigenvalues, ascending, shape ``[N·C]``.
        ggn_evals: GGN eigenvalues, ascending, shape ``[D]``.

    Returns:
        The left-out eigenvalues (possibly empty), ascending.
    """
    num_gram, num_ggn = _check_ascending(gram_evals), _check_ascending(ggn_evals)
    longer = gram_evals if num_gram >= num_ggn else ggn_evals
    return longer[: abs(num_gram - num_ggn)]


def _parameter_names(model: nn.Module, params: Sequence[Tensor]) -> list[str]:
    names = {id(p): name for name, p in model.named_parameters()}
    if len(params) == 0:
        raise ValueError("The parameter group is empty; pass at least one parameter.")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("The parameter group lists a parameter more than once.")
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(
            f"Entries {missing} of the parameter group are not parameters of the "
            "model; pass tensors from model.parameters()."
        )
    return [names[id(p)] for p in params]


def _check_outputs(outputs: Tensor, targets: Tensor) -> None:
    if outputs.dim() != 2 or outputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"Expected outputs of shape [N, C] with N = {targets.shape[0]} targets, "
            f"got {tuple(outputs.shape)}."
        )


def _check_subsampling(subsampling: list[int] | None, num_samples: int) -> list[int]:
    if subsampling is None:
        return list(range(num_samples))
    if len(subsampling) == 0:
        raise ValueError("subsampling is empty; pass None to use all samples.")
    if any(not 0 <= i < num_samples for i in subsampling):
        raise ValueError(
            f"subsampling {subsampling} has indices outside [0, {num_samples})."
        )
    return list(subsampling)


def _check_symmetric(matrix: Tensor, name: str) -> None:
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{name} must be square, got shape {tuple(matrix.shape)}.")
    scale = matrix.abs().max().clamp_min(1.0)
    asymmetry = (matrix - matrix.T).abs().max()
    if asymmetry > 1e-10 * scale:
        raise ValueError(f"{name} is not symmetric (max |A - Aᵀ| = {asymmetry:.3e}).")


def _check_ascending(evals: Tensor) -> int:
    if evals.dim() != 1:
        raise ValueError(f"Expected a vector of eigenvalues, got {tuple(evals.shape)}.")
    if (evals[1:] < evals[:-1]).any():
        raise ValueError("Eigenvalues must be sorted in ascending order.")
    return evals.numel()
