"""A loss BackPACK's GGN cannot handle is refused on every kind of step, basis and GGN.

The Kronecker basis runs BackPACK only on its refresh steps; between them the loss
module's forward pass is checked instead. Each case: a good start, then the bad loss
on a refresh step or on a step between refreshes; the step must raise a clear error
and leave the parameters and the optimizer state exactly as they were.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from backpack import extend
from torch import Tensor, nn

from dampednewton import DampedNewton, GramBasis, KroneckerBasis
from tests.cases import LINEAR_MSE, PROBLEMS, Problem
from tests.utils import (
    VIVIT_STEP,
    assert_parameters_equal,
    assert_same_state,
    build_case,
    make_closure,
    snapshot,
)

MLP_CE, MLP_BCE = PROBLEMS[0], PROBLEMS[2]
REWEIGHT = r"without weights and rebalance by sampling.*WeightedRandomSampler"
DROP = r"ignore before the model.*loss_fn\(model\(inputs\[keep\]\), targets\[keep\]\)"
SUM = r"uses reduction='sum', but the GGN computations and the diagnostics assume"
IGNORED = r"1 of the 4 targets equal CrossEntropyLoss's ignore_index=-100.*" + DROP


@dataclass(frozen=True)
class BadLoss:
    """A loss mistake: the loss module and targets of the bad step.

    Attributes:
        id: Readable identifier.
        problem: The problem the optimizer starts on (with its good loss).
        make_loss: The bad step's loss module (before ``extend`` and ``double``).
        targets: The bad step's targets from the problem's.
        match: Regular expression the error must contain.
    """

    id: str
    problem: Problem
    make_loss: Callable[[], nn.Module]
    targets: Callable[[Tensor], Tensor]
    match: str


def _same(targets: Tensor) -> Tensor:
    return targets


def _first_column(targets: Tensor) -> Tensor:
    return targets[:, :1]  # broadcasts against the (N, C) outputs


def _one_ignored(targets: Tensor) -> Tensor:
    return torch.cat([targets[:-1], torch.tensor([-100])])


BAD_LOSSES = [
    BadLoss("ce-sum", MLP_CE, lambda: nn.CrossEntropyLoss(reduction="sum"), _same, SUM),
    BadLoss("mse-sum", LINEAR_MSE, lambda: nn.MSELoss(reduction="sum"), _same, SUM),
    BadLoss(
        "ce-class-weights",
        MLP_CE,
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0])),
        _same,
        r"CrossEntropyLoss\(weight=\.\.\.\) is not supported.*" + REWEIGHT,
    ),
    BadLoss(
        "ce-ignore-index-set",
        MLP_CE,
        lambda: nn.CrossEntropyLoss(ignore_index=7),
        _same,
        r"ignore_index=7\) is not supported.*only the default ignore_index=-100.*"
        + DROP,
    ),
    BadLoss("ce-ignore-index-hit", MLP_CE, nn.CrossEntropyLoss, _one_ignored, IGNORED),
    BadLoss(
        "mse-broadcast",
        LINEAR_MSE,
        nn.MSELoss,
        _first_column,
        r"MSELoss got model outputs of shape \(4, 3\) and targets of shape \(4, 1\)",
    ),
    BadLoss(
        "bce-pos-weight",
        MLP_BCE,
        lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0])),
        _same,
        r"BCEWithLogitsLoss\(pos_weight=\.\.\.\) is not supported.*" + REWEIGHT,
    ),
    BadLoss(
        "bce-weight",
        MLP_BCE,
        lambda: nn.BCEWithLogitsLoss(weight=torch.full((6, 1), 2.0)),
        _same,
        r"BCEWithLogitsLoss\(weight=\.\.\.\) is not supported.*" + REWEIGHT,
    ),
]

BASES = {"kronecker": {}, "gram": VIVIT_STEP}
GOOD_STEPS = {"refresh": 1, "between-refreshes": 2}
"""Good steps before the bad one: the Kronecker default refreshes at steps 0, 1, 3."""


def _optimizer(problem: Problem, basis: str, mc_samples: int):
    case = build_case(problem)
    optimizer = DampedNewton(
        case.model.parameters(), mc_samples=mc_samples, seed=0, **BASES[basis]
    )
    return case, optimizer


def _assert_refused_without_trace(
    case, optimizer, closure, match: str, error: type[Exception] = ValueError
) -> None:
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    before = snapshot(optimizer)

    with pytest.raises(error, match=match):
        optimizer.step(closure)

    assert_parameters_equal(params, values)
    assert_same_state(snapshot(optimizer), before)


@pytest.mark.parametrize("mc_samples", [0, 1], ids=["exact", "monte-carlo"])
@pytest.mark.parametrize("when", list(GOOD_STEPS))
@pytest.mark.parametrize("basis", list(BASES))
@pytest.mark.parametrize("bad", BAD_LOSSES, ids=lambda bad: bad.id)
def test_a_bad_loss_module_seen_before_is_refused_on_any_step(
    bad: BadLoss, basis: str, when: str, mc_samples: int
):
    """The closure's loss module was seen by a refresh; its mistake is refused."""
    case, optimizer = _optimizer(bad.problem, basis, mc_samples)
    loss_fn = extend(bad.make_loss().double())
    targets = [case.y]

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(case.model(case.X), targets[0])
        loss.backward()
        return loss

    # Warm up on the same loss module, but a good configuration of it.
    good = {"reduction": "mean", "weight": None, "pos_weight": None}
    bad_options = {
        name: getattr(loss_fn, name) for name in good if hasattr(loss_fn, name)
    }
    ignore_index = getattr(loss_fn, "ignore_index", None)
    for name in bad_options:
        setattr(loss_fn, name, good[name])
    if ignore_index is not None:
        loss_fn.ignore_index = -100
    for _ in range(GOOD_STEPS[when]):
        optimizer.step(closure)
    for name, value in bad_options.items():
        setattr(loss_fn, name, value)
    if ignore_index is not None:
        loss_fn.ignore_index = ignore_index
    targets[0] = bad.targets(case.y)

    _assert_refused_without_trace(case, optimizer, closure, bad.match)


@pytest.mark.parametrize("bad", BAD_LOSSES, ids=lambda bad: bad.id)
def test_a_new_bad_loss_module_between_refreshes_is_refused_by_the_next_step(
    bad: BadLoss,
):
    """A loss module no refresh saw is watched from the step after it appears on.

    A step between refreshes runs no BackPACK pass, and it watches the loss modules
    a refresh saw (a global hook would slow every module's call), so the first step
    of a new loss module may be taken; the next one, between refreshes too, must be
    refused.
    """
    case, optimizer = _optimizer(bad.problem, "kronecker", 1)
    for _ in range(4):  # steps 0, 1, 2, 3: the next refresh is step 7
        optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        )
    loss_fn = extend(bad.make_loss().double())
    closure = make_closure(optimizer, case.model, loss_fn, case.X, bad.targets(case.y))
    try:
        optimizer.step(closure)
    except ValueError as error:
        assert re.search(bad.match, str(error))
        return

    assert optimizer.records["global"]["step"] == 5
    _assert_refused_without_trace(case, optimizer, closure, bad.match)


@pytest.mark.parametrize("basis", [KroneckerBasis(), GramBasis()], ids=repr)
def test_batch_norm_switched_to_training_mode_is_refused_between_refreshes(basis):
    """After model.eval() ... model.train() the next step refuses (no refresh).

    Back in eval mode training goes on.
    """
    torch.manual_seed(0)
    model = extend(
        nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    ).double()
    loss_fn = extend(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(8, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=generator)
    case = build_case(MLP_CE)
    case.model, case.loss_fn = model, loss_fn
    if isinstance(basis, KroneckerBasis):  # it steps Linear layers only
        model[1].requires_grad_(False)
    optimizer = DampedNewton(
        [p for p in model.parameters() if p.requires_grad], seed=0, basis=basis
    )
    closure = make_closure(optimizer, model, loss_fn, X, y)
    model.eval()
    for _ in range(2):  # steps 0 and 1 refresh; step 2 would not
        optimizer.step(closure)
    model.train()
    running_mean = model[1].running_mean.clone()
    _assert_refused_without_trace(
        case, optimizer, closure, "is in training mode", RuntimeError
    )
    assert not torch.equal(model[1].running_mean, running_mean)  # torch's forward
    model.eval()
    optimizer.step(closure)
    assert optimizer.records["global"]["step"] == 3


@pytest.mark.parametrize("basis", [KroneckerBasis(), GramBasis()], ids=repr)
def test_a_functional_loss_between_refreshes_is_refused_by_the_next_step(basis):
    """F.cross_entropy has no BackPACK module: refused (a refresh would be too).

    Between refreshes the first such step may be taken (the loss module might be a
    new one, watched from the next step on); the next one is refused.
    """
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), seed=0, basis=basis)
    for _ in range(4):  # both bases refresh at steps 0, 1, 3 and not at 4, 5, 6
        optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        )

    def functional():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(case.model(case.X), case.y)
        loss.backward()
        return loss

    optimizer.step(functional)
    _assert_refused_without_trace(
        case, optimizer, functional, "no BackPACK-extended loss module", RuntimeError
    )


KEEP = torch.tensor([True, False, True, True])
"""Drops the second of the 4 samples of the MLP problem."""


@dataclass(frozen=True)
class Between:
    """What a closure puts between the model and the loss, and its targets.

    Attributes:
        id: Readable identifier.
        output: The loss's input from the model's output.
        targets: The loss's targets from the problem's.
    """

    id: str
    output: Callable[[Tensor], Tensor]
    targets: Callable[[Tensor], Tensor] = _same


OPERATIONS = [
    Between("halved", lambda output: output / 2),
    Between("relu", torch.relu),
    Between("sample-dropped", lambda output: output[KEEP], lambda y: y[KEEP]),
]
SLICES = [  # views that start at the output's memory
    Between("first-samples", lambda output: output[:3], lambda y: y[:3]),
    Between("first-classes", lambda output: output[:, :2], lambda y: y.clamp(max=1)),
]
NO_OPERATIONS = [
    Between("view", lambda output: output.view(output.shape[0], -1)),
    Between("tuple-item", lambda output: (output, output.detach())[0]),
]
SLICE_REFUSAL = (
    r"CrossEntropyLoss took a part \(\d, \d\) of the model's output \(4, 3\)"
)
OPERATION_REFUSAL = (
    r"CrossEntropyLoss took the model's output through an operation \(such as "
    r"model\(inputs\) / 2"
)


def _defaults(basis: str):
    """The problem and the optimizer with a basis' defaults (refreshes at 0, 1, 3)."""
    case = build_case(MLP_CE)
    choice = KroneckerBasis() if basis == "kronecker" else GramBasis()
    return case, DampedNewton(case.model.parameters(), seed=0, basis=choice)


def _through(case, between: Between) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """The model followed by the operation, and the targets to go with it."""
    return (lambda X: between.output(case.model(X))), between.targets(case.y)


@pytest.mark.parametrize("when", list(GOOD_STEPS))
@pytest.mark.parametrize("basis", list(BASES))
@pytest.mark.parametrize("between", OPERATIONS + SLICES, ids=lambda between: between.id)
def test_an_operation_between_model_and_loss_is_refused_on_any_step(
    between: Between, basis: str, when: str
):
    """The loss module's forward pass refuses it, before any backward pass.

    BackPACK keys what it back-propagates by the output's memory, which an operation
    after the model changes: its pass would fail with an error that names a layer
    (or a wrong shape, where a freed address was reused). At a refresh the loss's
    input is compared with every extended module's output, between refreshes with
    those of the modules a refresh saw feeding the loss.
    """
    case, optimizer = _defaults(basis)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(GOOD_STEPS[when]):
        optimizer.step(closure)
    model, targets = _through(case, between)
    bad = make_closure(optimizer, model, case.loss_fn, case.X, targets)

    refusal = SLICE_REFUSAL if between in SLICES else OPERATION_REFUSAL
    _assert_refused_without_trace(case, optimizer, bad, refusal, RuntimeError)
    values = [p.detach().clone() for p in case.model.parameters()]
    optimizer.step(closure)  # back to the model's output, training goes on
    assert not all(map(torch.equal, values, case.model.parameters()))


@pytest.mark.parametrize("basis", list(BASES))
@pytest.mark.parametrize("between", NO_OPERATIONS, ids=lambda between: between.id)
def test_the_output_itself_passes_on_every_step(between: Between, basis: str):
    """A view of the output, or the output picked from a tuple, is the output.

    The steps equal those of a closure that passes the output directly.
    """
    runs = []
    for through in (None, between):
        case, optimizer = _defaults(basis)
        model, targets = (
            (case.model, case.y) if through is None else _through(case, through)
        )
        closure = make_closure(optimizer, model, case.loss_fn, case.X, targets)
        for _ in range(5):  # refreshes at steps 0, 1, 3; steps 2 and 4 in between
            optimizer.step(closure)
        runs.append(list(case.model.parameters()))
    assert_parameters_equal(*runs)


@pytest.mark.parametrize("basis", list(BASES))
def test_heads_that_take_turns_pass_between_refreshes(basis: str):
    """Heads that take turns are the model's outputs, not operations after it.

    A trunk and two heads, one per step in turn (refreshes at steps 0, 1, 3, 7; steps
    2, 4, 5, 6 between), then a third head, first at step 8, between refreshes: no
    step is refused. Each module has a group of its own: the Gram basis steps a group
    whose parameters all took part.
    """
    torch.manual_seed(0)
    trunk = extend(nn.Sequential(nn.Linear(5, 6), nn.Tanh())).double()
    heads = [extend(nn.Linear(6, 3)).double() for _ in range(3)]
    loss_fn = extend(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(8, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=generator)
    groups = [{"params": module.parameters()} for module in [trunk, *heads]]
    choice = KroneckerBasis() if basis == "kronecker" else GramBasis()
    optimizer = DampedNewton(groups, seed=0, basis=choice)

    for head in [*heads[:2] * 4, heads[2], heads[0]]:
        values = [p.detach().clone() for p in trunk.parameters()]
        optimizer.step(
            make_closure(optimizer, lambda X, head=head: head(trunk(X)), loss_fn, X, y)
        )
        assert not all(map(torch.equal, values, trunk.parameters()))


@pytest.mark.parametrize("when", list(GOOD_STEPS))
@pytest.mark.parametrize("basis", list(BASES))
def test_a_transposed_sequence_output_is_refused_with_a_layout_that_works(basis, when):
    """``CrossEntropyLoss(out.transpose(1, 2), y)`` on ``(N, T, C)`` outputs.

    The view starts at the output's memory, so BackPACK would take it for the output
    (its error named a reshape); refused at the loss, naming a head that works.
    """
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(4, 5, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 5), generator=generator)
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 3)).double())
    loss_fn = extend(nn.CrossEntropyLoss())
    choice = KroneckerBasis() if basis == "kronecker" else GramBasis()
    optimizer = DampedNewton(model.parameters(), seed=0, basis=choice)
    good = make_closure(optimizer, model, loss_fn, X[:, 0], y[:, 0])  # one position
    for _ in range(GOOD_STEPS[when]):
        optimizer.step(good)
    case = build_case(MLP_CE)
    case.model = model
    transposed = make_closure(
        optimizer, lambda X: model(X).transpose(1, 2), loss_fn, X, y
    )
    _assert_refused_without_trace(
        case,
        optimizer,
        transposed,
        r"took the model's output \(4, 5, 3\) reshaped, transposed or permuted to "
        r"\(4, 3, 5\).*nn\.Conv1d",
        RuntimeError,
    )


@pytest.mark.parametrize("when", list(GOOD_STEPS))
@pytest.mark.parametrize("basis", list(BASES))
def test_a_later_forward_pass_with_gradients_is_refused_at_the_loss(basis, when):
    """An auxiliary forward pass with gradients before the loss is refused.

    BackPACK keeps its inputs, not the loss's; refused on every step. Under
    ``no_grad`` it passes.
    """
    case, optimizer = _defaults(basis)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(GOOD_STEPS[when]):
        optimizer.step(closure)

    def auxiliary(grad: bool) -> Callable[[], Tensor]:
        def closure() -> Tensor:
            optimizer.zero_grad()
            output = case.model(case.X)
            with torch.set_grad_enabled(grad):
                case.model(case.X[:2])  # e.g. a metric on other inputs
            loss = case.loss_fn(output, case.y)
            loss.backward()
            return loss

        return closure

    _assert_refused_without_trace(
        case,
        optimizer,
        auxiliary(True),
        r"took the output of a forward pass of the model after which the closure "
        r"ran another one with gradients.*torch\.no_grad\(\)",
        RuntimeError,
    )
    optimizer.step(auxiliary(False))


@pytest.mark.parametrize("when", list(GOOD_STEPS))
@pytest.mark.parametrize("loss", [nn.BCEWithLogitsLoss, nn.MSELoss], ids=repr)
def test_a_squeezed_single_output_gets_the_loss_checks_advice(loss, when):
    """``loss_fn(model(X).squeeze(1), y)`` gets the advice to keep ``(N, 1)``.

    Common for one output per sample: the loss checks' refusal, which names the
    shape to use, on every step (not the layout refusal of other views).
    """
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 2, (8, 1), generator=generator).double()
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).double())
    loss_fn = extend(loss())
    optimizer = DampedNewton(model.parameters(), seed=0)
    for _ in range(GOOD_STEPS[when]):
        optimizer.step(make_closure(optimizer, model, loss_fn, X, y))
    case = build_case(MLP_CE)
    case.model = model
    squeezed = make_closure(
        optimizer, lambda X: model(X).squeeze(1), loss_fn, X, y.squeeze(1)
    )
    _assert_refused_without_trace(
        case, optimizer, squeezed, r"outputs of shape \(8,\).*use \(N, 1\)"
    )
