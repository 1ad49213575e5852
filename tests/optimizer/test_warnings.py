"""Warnings of a step: torch's hook warning filtered at the source, ours once per group.

Every check records with ``simplefilter("always")``, which overrides the
project-wide pytest filter of torch's hook warning and Python's once-per-location
registry: what the user would see at worst.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from backpack import backpack
from packaging.version import Version

from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    EigvalshComputation,
    GramBasis,
    LevenbergMarquardt,
)
from dampednewton.backpack.backward import FULL_BACKWARD_HOOK_WARNING
from dampednewton.diagnostics import GSNR, DiagnosticsMonitor
from tests.cases import PROBLEMS, readme_problem
from tests.utils import EXACT_VIVIT_STEP, build_case, make_closure

MLP_CE = PROBLEMS[0]
HOOK_WARNING = "Full backward hook is firing"


# torch 2.4.1 (`make test-floor`), 2.5.1, 2.6.0 and 2.7.1 emit no full-backward-hook
# warning for this problem: nothing to silence there.
EMITS_HOOK_WARNING = pytest.mark.skipif(
    Version(torch.__version__).release[:2] < (2, 8),
    reason="torch < 2.8 emits no full-backward-hook warning here",
)


def recorded(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    return record


@EMITS_HOOK_WARNING
def test_the_hook_warning_exists_outside_the_optimizer():
    """The guard of the test below: BackPACK's hooks do trigger torch's warning."""
    model, loss_fn, X, y = readme_problem()

    record = recorded(lambda: loss_fn(model(X), y).backward())

    assert any(HOOK_WARNING in str(r.message) for r in record)
    assert HOOK_WARNING in FULL_BACKWARD_HOOK_WARNING


@EMITS_HOOK_WARNING
def test_step_silences_the_hook_warning_and_nothing_else():
    model, loss_fn, X, y = readme_problem()
    # LM calls the closure a second time, outside the BackPACK context.
    for damping in (0.1, LevenbergMarquardt()):
        optimizer = DampedNewton(model.parameters(), damping=damping)

        def closure(optimizer=optimizer):
            optimizer.zero_grad()
            loss = loss_fn(model(X), y)
            loss.backward()
            warnings.warn("the user's own warning", UserWarning, stacklevel=1)
            return loss

        record = recorded(lambda optimizer=optimizer: optimizer.step(closure))

        assert not [r for r in record if HOOK_WARNING in str(r.message)]
        own = [r for r in record if "the user's own warning" in str(r.message)]
        assert len(own) == (2 if damping != 0.1 else 1)
    # Outside the step, the filters are as before.
    after = recorded(lambda: loss_fn(model(X), y).backward())
    assert any(HOOK_WARNING in str(r.message) for r in after)


def test_small_eigenvalues_warn_once_per_group_and_are_counted():
    case = build_case(MLP_CE)
    first, second = (list(layer.parameters()) for layer in case.model[::2])
    optimizer = DampedNewton(
        [{"params": first, "criterion": 1}, {"params": second}],
        damping=1.0,
        criterion=2,
        warn_small_eigvals=1e3,  # every eigenvalue counts as small
        **EXACT_VIVIT_STEP,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)

    record = recorded(lambda: [optimizer.step(closure) for _ in range(3)])

    small = [str(r.message) for r in record if "warn_small_eigvals" in str(r.message)]
    assert len(small) == 2, small
    assert "1 of the 1 GGN eigenvalues selected in parameter group 0" in small[0]
    assert "2 of the 2 GGN eigenvalues selected in parameter group 1" in small[1]
    assert {r.filename for r in record} == {__file__}
    stats = optimizer.records["groups"]
    assert [s["steps_with_small_eigenvalues"] for s in stats] == [3, 3]


def test_small_eigenvalue_threshold_is_per_group():
    case = build_case(MLP_CE)
    first, second = (list(layer.parameters()) for layer in case.model[::2])
    optimizer = DampedNewton(
        [{"params": first}, {"params": second, "warn_small_eigvals": 0}],
        damping=1.0,
        criterion=2,
        warn_small_eigvals=1e3,
        **EXACT_VIVIT_STEP,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)

    record = recorded(lambda: optimizer.step(closure))

    small = [str(r.message) for r in record if "warn_small_eigvals" in str(r.message)]
    assert len(small) == 1 and "parameter group 0" in small[0], small
    stats = optimizer.records["groups"]
    assert "steps_with_small_eigenvalues" not in stats[1]


def test_monitor_context_silences_the_hook_warning_and_nothing_else():
    """The diagnostics context runs BackPACK's hooks too: same filter, same scope."""
    model, loss_fn, X, y = readme_problem()
    monitor = DiagnosticsMonitor([GSNR()], model.named_parameters())

    def monitored_backward():
        loss = loss_fn(model(X), y)
        with monitor.backward_context(0, loss):
            loss.backward()
            warnings.warn("the user's own warning", UserWarning, stacklevel=1)

    record = recorded(monitored_backward)

    assert not [r for r in record if HOOK_WARNING in str(r.message)]
    assert [r for r in record if "the user's own warning" in str(r.message)]
    assert monitor.log.series("gsnr/mean")[0].tolist() == [0]


@pytest.mark.parametrize("mc_samples", [0, 1], ids=["exact", "mc1"])
def test_a_scaled_loss_warns_as_backpack_does_after_the_step(mc_samples):
    """BackPACK's check that the loss was not scaled, read with the step's checks."""
    case = build_case(MLP_CE)
    optimizer = DampedNewton(
        case.model.parameters(), damping=1.0, mc_samples=mc_samples, seed=0
    )

    def scaled_closure():
        optimizer.zero_grad()
        loss = case.loss_fn(case.model(case.X), case.y)
        (2 * loss).backward()
        return loss

    messages = [
        str(w.message) for w in recorded(lambda: optimizer.step(scaled_closure))
    ]
    assert any("seems to have been modified" in m for m in messages), messages
    unscaled = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    messages = [str(w.message) for w in recorded(lambda: optimizer.step(unscaled))]
    assert not any("seems to have been modified" in m for m in messages), messages


def test_the_computations_keep_backpacks_own_warning():
    case = build_case(MLP_CE)
    computation = EigvalshComputation()
    group = {"params": list(case.model.parameters())}

    def scaled_backward():
        with backpack(
            *computation.get_extensions(),
            extension_hook=computation.get_extension_hook([group]),
        ):
            (2 * case.loss_fn(case.model(case.X), case.y)).backward()

    messages = [str(w.message) for w in recorded(scaled_backward)]
    assert any("seems to have been modified" in m for m in messages), messages


@pytest.mark.parametrize(
    "options",
    [
        {"criterion": 8},
        {"complement": None},
        {"complement": 0.5},
        {"newton_fraction": 0.3},
        {"averaging": CurvatureAveraging(rank=4)},
    ],
    ids=["criterion", "no-complement", "complement", "newton-fraction", "rank"],
)
def test_gram_options_given_to_the_kronecker_basis_warn(options):
    """They would do nothing; the defaults and the Gram basis stay silent."""
    params = [torch.nn.Parameter(torch.ones(2))]
    name = "averaging's rank" if "averaging" in options else next(iter(options))
    with pytest.warns(UserWarning, match=rf"directions \({name}\).* have no effect"):
        DampedNewton(params, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DampedNewton(params)
        DampedNewton(params, basis=GramBasis(), **options)
        DampedNewton([{"params": params, "basis": GramBasis()}], **options)


@pytest.mark.parametrize("how", ["constructor", "add_param_group"])
def test_gram_options_of_a_kronecker_group_warn_at_the_callers_line(how):
    """Per group too, naming the group; the warning points at the user's call."""
    first, second = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    with pytest.warns(UserWarning, match=r"\(criterion\) in parameter group 1") as w:
        if how == "constructor":
            DampedNewton([{"params": [first]}, {"params": [second], "criterion": 4}])
        else:
            DampedNewton([first]).add_param_group({"params": [second], "criterion": 4})
    assert [Path(r.filename).name for r in w] == [Path(__file__).name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = [{"params": [first]}, {"params": [second], "criterion": 4}]
        DampedNewton(groups, basis=GramBasis())
