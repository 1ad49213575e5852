"""Input checks shared by the brute-force references."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn


def parameter_names(model: nn.Module, params: Sequence[Tensor]) -> list[str]:
    """The names of ``params`` in ``model``; refuses empty, repeated, foreign ones."""
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


def check_outputs(outputs: Tensor, targets: Tensor) -> None:
    """Refuse outputs that are not of shape ``[N, C]`` with one row per target."""
    if outputs.dim() != 2 or outputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"Expected outputs of shape [N, C] with N = {targets.shape[0]} targets, "
            f"got {tuple(outputs.shape)}."
        )


def check_subsampling(subsampling: list[int] | None, num_samples: int) -> list[int]:
    """The sample indices to use: all for ``None``, else checked to lie in range."""
    if subsampling is None:
        return list(range(num_samples))
    if len(subsampling) == 0:
        raise ValueError("subsampling is empty; pass None to use all samples.")
    if any(not 0 <= i < num_samples for i in subsampling):
        raise ValueError(
            f"subsampling {subsampling} has indices outside [0, {num_samples})."
        )
    return list(subsampling)


def check_symmetric(matrix: Tensor, name: str) -> None:
    """Refuse a matrix that is not square and symmetric up to round-off."""
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{name} must be square, got shape {tuple(matrix.shape)}.")
    scale = matrix.abs().max().clamp_min(1.0)
    asymmetry = (matrix - matrix.T).abs().max()
    if asymmetry > 1e-10 * scale:
        raise ValueError(f"{name} is not symmetric (max |A - Aᵀ| = {asymmetry:.3e}).")


def check_ascending(evals: Tensor) -> int:
    """The number of eigenvalues; refuses a non-vector or an unsorted one."""
    if evals.dim() != 1:
        raise ValueError(f"Expected a vector of eigenvalues, got {tuple(evals.shape)}.")
    if (evals[1:] < evals[:-1]).any():
        raise ValueError("Eigenvalues must be sorted in ascending order.")
    return evals.numel()
