"""Bad input raises clear errors; the reference implementation's traps are avoided."""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import backpack, extend
from torch import nn

from dampednewton import (
    DirectionalDampedNewtonComputation,
    EighComputation,
    EigvalshComputation,
    TopK,
)
from tests import reference
from tests.assertions import assert_close
from tests.cases import PROBLEMS
from tests.utils import build_case

MLP_CE = PROBLEMS[0]


def backward(computation, model, loss_fn, X, y, groups) -> None:
    hook = computation.get_extension_hook(groups)
    with backpack(*computation.get_extensions(), extension_hook=hook):
        loss_fn(model(X), y).backward()


def reference_step(case, params, k: int, damping: float):
    ref_params = case.reference_params(params)
    args = (case.reference_model, case.reference_loss_fn, ref_params, case.X, case.y)
    G = reference.ggn(*args)
    Gn = reference.per_sample_ggns(*args)
    grads = reference.per_sample_gradients(*args)
    return reference.damped_newton_step(
        G, Gn, grads, k, torch.full((k,), damping, dtype=G.dtype)
    )


@pytest.mark.parametrize("missing", ["params", "criterion", "damping"])
def test_missing_group_key(missing):
    case = build_case(MLP_CE)
    group = {"params": list(case.model.parameters()), "criterion": 2, "damping": 1.0}
    del group[missing]
    with pytest.raises(KeyError, match=f"'{missing}'"):
        DirectionalDampedNewtonComputation().get_extension_hook([group])


def test_parameter_in_two_groups():
    case = build_case(MLP_CE)
    params = list(case.model.parameters())
    groups = [{"params": params}, {"params": params[:1]}]
    with pytest.raises(ValueError, match=r"in groups 0 and 1; .*one group"):
        EigvalshComputation().get_extension_hook(groups)


def test_parameter_twice_in_a_group():
    case = build_case(MLP_CE)
    params = list(case.model.parameters())
    with pytest.raises(ValueError, match=r"twice in group 0; .*once"):
        EigvalshComputation().get_extension_hook([{"params": [*params, params[0]]}])


@pytest.mark.parametrize(
    "kwargs",
    [{"subsampling_ggn": [0, 1, 1]}, {"subsampling_grad": [2, 2]}],
    ids=["ggn", "grad"],
)
def test_repeated_subsampling_indices(kwargs):
    with pytest.raises(ValueError, match="repeats"):
        DirectionalDampedNewtonComputation(**kwargs)


@pytest.mark.parametrize("computation", [EigvalshComputation, EighComputation])
def test_subsampling_errors_name_the_argument(computation):
    """Eigenvalue and eigenpair computations take ViViT's ``subsampling``."""
    with pytest.raises(ValueError, match=r"^subsampling holds a negative"):
        computation(subsampling=[0, -1])


def test_subsampling_out_of_range():
    case = build_case(MLP_CE)
    computation = EigvalshComputation(subsampling=[0, 99])
    groups = [{"params": list(case.model.parameters())}]
    with pytest.raises(IndexError, match="99"):
        backward(computation, case.model, case.loss_fn, case.X, case.y, groups)


def test_sum_reduction_is_refused():
    case = build_case(MLP_CE)
    loss_fn = extend(nn.CrossEntropyLoss(reduction="sum"))
    groups = [{"params": list(case.model.parameters())}]
    with pytest.raises(ValueError, match="reduction='mean'"):
        backward(EigvalshComputation(), case.model, loss_fn, case.X, case.y, groups)


def test_unsupported_module_is_named():
    model = extend(nn.Sequential(nn.Linear(5, 4), nn.Softsign(), nn.Linear(4, 3)))
    loss_fn = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 0])
    groups = [{"params": list(model.parameters())}]
    with pytest.raises(
        NotImplementedError, match=r"Softsign.*Supported modules: .*ReLU"
    ):
        backward(EigvalshComputation(), model, loss_fn, X, y, groups)


def test_batchnorm_in_train_mode_is_refused():
    model = extend(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)))
    loss_fn = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 0])
    groups = [{"params": list(model.parameters())}]
    with pytest.raises(RuntimeError, match=r"training mode.*model.eval\(\)"):
        backward(EigvalshComputation(), model, loss_fn, X, y, groups)
    model.eval()
    backward(EigvalshComputation(), model, loss_fn, X, y, groups)


def test_loss_not_extended():
    case = build_case(MLP_CE)
    groups = [{"params": list(case.model.parameters())}]
    with pytest.raises(RuntimeError, match=r"backpack.extend\(loss_fn\)"):
        backward(
            EigvalshComputation(),
            case.model,
            nn.CrossEntropyLoss(),
            case.X,
            case.y,
            groups,
        )


def test_get_result_without_result():
    case = build_case(MLP_CE)
    group = {"params": list(case.model.parameters())}
    computation = EigvalshComputation()
    computation.get_extension_hook([group])
    with pytest.raises(KeyError, match="No result"):
        computation.get_result(group)
    other = {"params": [nn.Parameter(torch.zeros(2))]}
    backward(computation, case.model, case.loss_fn, case.X, case.y, [group])
    with pytest.raises(KeyError, match="No result"):
        computation.get_result(other)


def test_get_result_of_a_group_without_trainable_parameters():
    """The group has no GGN block: the error says so instead of blaming the pass."""
    case = build_case(MLP_CE)
    first, last = case.model[0], case.model[-1]
    first.requires_grad_(False)
    groups = [{"params": list(first.parameters())}, {"params": list(last.parameters())}]
    computation = EigvalshComputation()
    backward(computation, case.model, case.loss_fn, case.X, case.y, groups)
    assert computation.get_result(groups[1]).numel() > 0
    with pytest.raises(KeyError, match=r"requires_grad=False.*leave it out"):
        computation.get_result(groups[0])


def test_criterion_out_of_range():
    case = build_case(MLP_CE)
    group = {"params": list(case.model.parameters()), "criterion": lambda evals: [99]}
    with pytest.raises(IndexError, match="99"):
        backward(EighComputation(), case.model, case.loss_fn, case.X, case.y, [group])


def test_frozen_parameter_in_group():
    """A parameter without gradient is outside the GGN block: its step is zero."""
    case = build_case(MLP_CE)
    params = list(case.model.parameters())
    params[0].requires_grad_(False)
    case.reference_params(params)[0].requires_grad_(False)
    group = {"params": params, "criterion": TopK(2), "damping": 0.5}
    computation = DirectionalDampedNewtonComputation()
    for _ in range(2):  # the second pass must give a fresh result, not the first
        backward(computation, case.model, case.loss_fn, case.X, case.y, [group])
        step = computation.get_result(group)
        assert torch.equal(step[0], torch.zeros_like(params[0]))
        expected = reference_step(case, params[1:], k=2, damping=0.5)
        assert_close(reference.flatten(step[1:]), expected, name="step")
        with torch.no_grad():
            for p, ref_p in zip(params, case.reference_params(params), strict=True):
                p.add_(0.1)
                ref_p.add_(0.1)


def test_reuse_across_steps_and_batch_sizes():
    """One computation object, several passes, changing batch sizes: fresh results."""
    case = build_case(MLP_CE)
    params = list(case.model.parameters())
    group = {"params": params, "criterion": TopK(2), "damping": 0.5}
    computation = DirectionalDampedNewtonComputation()
    hook = computation.get_extension_hook([group])
    for num_samples in (4, 3, 2):
        X, y = case.X[:num_samples], case.y[:num_samples]
        with backpack(*computation.get_extensions(), extension_hook=hook):
            case.loss_fn(case.model(X), y).backward()
        sub_case = build_case(MLP_CE)
        sub_case.X, sub_case.y = X, y
        expected = reference_step(sub_case, list(sub_case.model.parameters()), 2, 0.5)
        assert_close(reference.flatten(computation.get_result(group)), expected)
        leaked = [
            name
            for p in params
            for name in ("sqrt_ggn_exact", "grad_batch")
            if hasattr(p, name)
        ]
        assert not leaked, f"BackPACK buffers left on parameters: {leaked}"


@pytest.mark.parametrize("layer", ["first", "last"])
def test_group_covering_one_layer(layer):
    case = build_case(MLP_CE)
    linear = case.model[0] if layer == "first" else case.model[-1]
    group = {"params": list(linear.parameters()), "criterion": TopK(2), "damping": 0.1}
    computation = DirectionalDampedNewtonComputation()
    backward(computation, case.model, case.loss_fn, case.X, case.y, [group])
    expected = reference_step(case, group["params"], k=2, damping=0.1)
    assert_close(reference.flatten(computation.get_result(group)), expected)


def test_small_selected_eigenvalues_warn():
    case = build_case(MLP_CE)
    group = {"params": list(case.model.parameters()), "criterion": TopK(2)}
    computation = EighComputation(warn_small_eigvals=1e3)  # every eigenvalue is small
    with pytest.warns(UserWarning, match="below warn_small_eigvals=1000"):
        backward(computation, case.model, case.loss_fn, case.X, case.y, [group])
    quiet = EighComputation(warn_small_eigvals=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="Full backward hook")
        backward(quiet, case.model, case.loss_fn, case.X, case.y, [group])
