r"""The Kronecker basis' step: refreshes of the layers' factors and every step.

A step of groups with :class:`~dampednewton.policies.basis.KroneckerBasis` runs the
closure once. On a refresh (the averaging's schedule, a loss that rose above its
tolerance, or the first step) it runs inside a BackPACK pass whose hook
(:class:`~dampednewton.backpack.kronecker_factors.FactorCollector`) turns each layer's
square-root buffers into its factors ``A`` and ``S``; the averages
``F ← βF + (1 − β)F_batch`` are bias-corrected by ``1 − β^t`` and decomposed
(:func:`~dampednewton.math.kronecker.factor_eigen`). Every other step runs the
closure with BackPACK's hooks suspended and reuses the layers' eigenpairs.

Each layer's direction is :func:`~dampednewton.math.kronecker.kronecker_direction` of
its gradient; a group's quadratic model sums its layers' slopes and curvatures, and
its trust region ``ν`` bounds ``½ lr² ν² (−ḡᵀs)`` by ``kl_clip``. One host read per
step carries the loss, every group's slope and curvature (a non-finite gradient,
factor or direction makes them non-finite); a refresh reads the new factors'
finiteness first. A refused step leaves parameters, state and generator untouched:
the new factors are committed only with an accepted step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Generator, Tensor

from dampednewton._step.closure import run_closure
from dampednewton._step.guard import STACKLEVEL_OF_CALLER, GeneratorSnapshot, refuse
from dampednewton._step.kronecker_state import (
    INPUT_EIGEN,
    INPUT_FACTOR,
    LAYERS,
    OUTPUT_EIGEN,
    OUTPUT_FACTOR,
    UPDATES,
    LayerBasis,
    eigen_entries,
    stored_bases,
)
from dampednewton._step.options import GroupOptions, SharedOptions
from dampednewton._step.records import REFRESH_DUE, REFRESH_LOSS
from dampednewton._step.step_pass import with_monitor
from dampednewton._step.update import update_parameter
from dampednewton.backpack.extensions import ExactSqrtGGN, MonteCarloSqrtGGN
from dampednewton.backpack.hooks import ExtendedModules
from dampednewton.backpack.kronecker_factors import FactorCollector, LayerFactors
from dampednewton.backpack.layers import use_structured_sqrt_ggn
from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.backpack.savefields import sqrt_ggn_savefield
from dampednewton.diagnostics import DiagnosticsMonitor
from dampednewton.distributed import Communicator
from dampednewton.math.kronecker import factor_eigen, kronecker_direction
from dampednewton.math.precision import computation_dtype
from dampednewton.policies.basis import KroneckerBasis


@dataclass(frozen=True)
class KroneckerGroupStep:
    """A group's direction and quadratic model (what adaptive damping reads).

    Attributes:
        directions: ``(parameter, its direction s)`` pairs.
        slope: ``ḡᵀs`` (0-dim).
        curvature: ``sᵀ(S ⊗ A)s`` summed over the layers (0-dim).
    """

    directions: list[tuple[Tensor, Tensor]]
    slope: Tensor
    curvature: Tensor


def group_step(bases: Sequence[LayerBasis], damping: float) -> KroneckerGroupStep:
    """A group's step along its layers' Kronecker eigenbases.

    Args:
        bases: The group's layers with their eigenpairs.
        damping: ``δ``.

    Returns:
        The directions of every parameter and the group's quadratic model.
    """
    directions: list[tuple[Tensor, Tensor]] = []
    slope: Tensor | float = 0.0
    curvature: Tensor | float = 0.0
    for basis in bases:
        layer = kronecker_direction(
            basis.gradient(basis.output.vectors),
            basis.output,
            basis.inputs,
            damping,
        )
        directions += basis.split(layer.direction)
        slope = slope + layer.slope
        curvature = curvature + layer.curvature
    like = bases[0].output.values
    return KroneckerGroupStep(
        directions, torch.as_tensor(slope).to(like), torch.as_tensor(curvature).to(like)
    )


def damping_value(options: GroupOptions) -> float:
    """The group's ``δ`` (its policy's current value)."""
    return float(options.damping.value)  # type: ignore[attr-defined]


class KroneckerSteps:
    """Steps of Kronecker-basis groups; keeps the layers' bases between steps."""

    def __init__(self) -> None:
        """Start without cached bases."""
        self._bases: dict[int, list[LayerBasis]] = {}

    def clear(self) -> None:
        """Forget the cached bases (after a refresh or loading a state)."""
        self._bases.clear()

    def refreshing(
        self,
        options: Sequence[GroupOptions],
        stats: Sequence[dict[str, Any]],
        step: int,
        due: bool,
    ) -> list[bool]:
        """Which groups refresh their factors this step."""
        return [
            due
            or option.averaging is None
            or LAYERS not in group
            or option.averaging.refreshes(step, group.get(UPDATES, 0))
            for option, group in zip(options, stats, strict=True)
        ]

    def run(
        self,
        closure: Callable[[], Tensor],
        groups: Sequence[dict[str, Any]],
        options: Sequence[GroupOptions],
        shared: SharedOptions,
        state: Any,
        stats: list[dict[str, Any]],
        *,
        step: int,
        generator: Generator | None,
        monitor: DiagnosticsMonitor | None,
        communicator: Communicator | None,
        nonfinite: str,
        modules: ExtendedModules,
        global_state: dict[str, Any],
    ) -> tuple[Tensor, list[KroneckerGroupStep | None], list[float], dict | None]:
        """Run the closure and move every group; see the module docstring.

        Returns:
            The loss, every group's step (``None`` for a refused step), the
            trust-region scales and the monitor's record (if any).
        """
        refreshing = self.refreshing(
            options, stats, step, bool(global_state.get(REFRESH_DUE, False))
        )
        params = [p for group in groups for p in group["params"]]
        extensions: list = []
        hooks: list = []
        collector = None
        deferred = DeferredChecks()
        if any(refreshing):
            sqrt_ggn = (
                MonteCarloSqrtGGN(shared.mc_samples, shared.subsampling_ggn, generator)
                if shared.mc_samples > 0
                else ExactSqrtGGN(subsampling=shared.subsampling_ggn)
            )
            use_structured_sqrt_ggn(sqrt_ggn)
            sqrt_ggn.deferred_checks = deferred
            collected = [
                p
                for group, refresh in zip(groups, refreshing, strict=True)
                if refresh
                for p in group["params"]
                if p.requires_grad
            ]
            collector = FactorCollector(
                sqrt_ggn_savefield(shared.mc_samples), collected, sqrt_ggn
            )
            extensions, hooks = [sqrt_ggn], [collector.hook]
        if monitor is not None:
            extensions, hooks = with_monitor(extensions, hooks, monitor, step, None)
        with GeneratorSnapshot(generator) as snapshot:
            loss = run_closure(
                closure,
                params,
                extensions,
                hooks,
                modules,
                accumulation=monitor is None,
            )
            if not isinstance(loss, Tensor):
                raise TypeError(
                    "The closure must return the loss tensor, got "
                    f"{type(loss).__name__}."
                )
            if communicator is not None:
                loss = communicator.mean_loss_of_pass(loss, None)
            factors = {} if collector is None else collector.layers
            if communicator is not None and factors:
                _mean_over_ranks(factors, communicator)
            problem = None
            fresh: dict[int, list[tuple[LayerBasis, Tensor, Tensor]]] = {}
            if factors and not _all_finite(factors):
                problem = "the curvature (the layers' Kronecker factors) is not finite"
            else:
                for index, refresh in enumerate(refreshing):
                    if refresh:
                        fresh[index] = self._refreshed(
                            groups[index],
                            options[index],
                            stats[index],
                            state,
                            factors,
                        )
            steps: list[KroneckerGroupStep | None] = []
            for index, group in enumerate(groups):
                bases = (
                    [entry[0] for entry in fresh[index]]
                    if index in fresh
                    else self._bases_of(index, group, stats[index], state)
                )
                steps.append(
                    None
                    if problem is not None or not bases
                    else group_step(bases, damping_value(options[index]))
                )
            values = _read(loss, steps, deferred)
            if problem is None:
                problem = _problem(values, loss, deferred)
            if communicator is not None:
                refused = communicator.any_refuses(problem is not None)
                if refused and problem is None:
                    problem = "another rank refused the step"
            if problem is not None:
                snapshot.restore()
                refuse(problem, nonfinite, stacklevel=STACKLEVEL_OF_CALLER + 1)
                global_state["skipped_steps"] += 1
                return loss, [None] * len(groups), [1.0] * len(groups), None
            record = None
            if monitor is not None:
                record = monitor.finish(step, params, loss)
        self._commit(fresh, groups, stats, state)
        if fresh:
            global_state.update({REFRESH_DUE: False, REFRESH_LOSS: loss.detach()})
        scales = []
        for index, (option, group_result) in enumerate(
            zip(options, steps, strict=True)
        ):
            slope = values["slopes"][index]
            scale = _trust_scale(option, slope)
            scales.append(scale)
            if group_result is not None:
                _apply(group_result, option, state, scale)
        self._check_loss_rise(options, global_state, values["loss"], fresh)
        return loss, steps, scales, record

    def _bases_of(
        self, index: int, group: dict[str, Any], stats: dict[str, Any], state: Any
    ) -> list[LayerBasis] | None:
        bases = self._bases.get(index)
        if bases is None:
            bases = stored_bases(state, stats, group["params"])
            if bases is not None:
                self._bases[index] = bases
        return bases

    def _refreshed(
        self,
        group: dict[str, Any],
        option: GroupOptions,
        stats: dict[str, Any],
        state: Any,
        factors: dict[int, LayerFactors],
    ) -> list[tuple[LayerBasis, Tensor, Tensor]]:
        """The group's layers with their updated (uncommitted) averages and bases."""
        basis_policy = option.basis
        assert isinstance(basis_policy, KroneckerBasis)
        decay = 0.0 if option.averaging is None else option.averaging.decay
        updates = stats.get(UPDATES, 0) + 1
        correction = 1 - decay**updates
        layers = []
        for param in group["params"]:
            layer = factors.get(id(param))
            if layer is None:
                continue
            first_state = state[param]
            inputs, outputs = layer.mean()
            if decay > 0 and INPUT_FACTOR in first_state:
                inputs = decay * first_state[INPUT_FACTOR] + (1 - decay) * inputs
                outputs = decay * first_state[OUTPUT_FACTOR] + (1 - decay) * outputs
            else:
                inputs, outputs = (1 - decay) * inputs, (1 - decay) * outputs
            previous_in = first_state.get(INPUT_EIGEN, {}).get("vectors")
            previous_out = first_state.get(OUTPUT_EIGEN, {}).get("vectors")
            rank = basis_policy.rank
            basis = LayerBasis(
                layer.weight,
                layer.bias,
                factor_eigen(outputs / correction, rank, previous_out),
                factor_eigen(inputs / correction, rank, previous_in),
            )
            layers.append((basis, inputs, outputs))
        missing = [
            p
            for p in group["params"]
            if p.requires_grad
            and not any(p is b.weight or p is b.bias for b, _, _ in layers)
        ]
        if missing:
            raise RuntimeError(
                "No curvature reached a parameter of shape "
                f"{tuple(missing[0].shape)}: extend model and loss function with "
                "BackPACK (`model = backpack.extend(model)`, `loss_fn = "
                "backpack.extend(loss_fn)`), call `loss.backward()` in the closure "
                "and use every parameter in the forward pass."
            )
        return layers

    def _commit(
        self,
        fresh: dict[int, list[tuple[LayerBasis, Tensor, Tensor]]],
        groups: Sequence[dict[str, Any]],
        stats: list[dict[str, Any]],
        state: Any,
    ) -> None:
        for index, layers in fresh.items():
            params = groups[index]["params"]
            position = {id(p): i for i, p in enumerate(params)}
            pairs = []
            for basis, inputs, outputs in layers:
                state[basis.first].update(
                    {
                        INPUT_FACTOR: inputs,
                        OUTPUT_FACTOR: outputs,
                        INPUT_EIGEN: eigen_entries(basis.inputs),
                        OUTPUT_EIGEN: eigen_entries(basis.output),
                    }
                )
                pairs.append(
                    (
                        None if basis.weight is None else position[id(basis.weight)],
                        None if basis.bias is None else position[id(basis.bias)],
                    )
                )
            stats[index][LAYERS] = tuple(pairs)
            stats[index][UPDATES] = stats[index].get(UPDATES, 0) + 1
            self._bases[index] = [basis for basis, _, _ in layers]

    def _check_loss_rise(
        self,
        options: Sequence[GroupOptions],
        global_state: dict[str, Any],
        loss: float,
        fresh: dict,
    ) -> None:
        tolerances = [
            option.averaging.loss_tolerance
            for option in options
            if option.averaging is not None
            and option.averaging.loss_tolerance is not None
        ]
        reference = global_state.get(REFRESH_LOSS)
        if fresh or not tolerances or reference is None:
            return
        if loss > (1 + min(tolerances)) * float(reference):
            global_state[REFRESH_DUE] = True


def _mean_over_ranks(
    factors: dict[int, LayerFactors], communicator: Communicator
) -> None:
    """Average every layer's factor sums over the ranks in one all-reduce."""
    layers = list(factors.values())
    flat = torch.cat(
        [t.reshape(-1) for layer in layers for t in (layer.inputs, layer.outputs)]
        + [torch.stack([layer.total for layer in layers])]
    )
    summed = communicator.sum_over_ranks(flat)
    offset = 0
    for layer in layers:
        for name in ("inputs", "outputs"):
            tensor = getattr(layer, name)
            size = tensor.numel()
            setattr(layer, name, summed[offset : offset + size].view_as(tensor))
            offset += size
    for layer, total in zip(layers, summed[offset:], strict=True):
        layer.total = total


def _all_finite(factors: dict[int, LayerFactors]) -> bool:
    """Whether every factor is finite (one host read)."""
    sums = torch.stack(
        [
            (layer.inputs.sum() + layer.outputs.sum()).to(torch.float64)
            for layer in factors.values()
        ]
    )
    return bool(torch.isfinite(sums).all())


def _read(
    loss: Tensor, steps: Sequence[KroneckerGroupStep | None], deferred: DeferredChecks
) -> dict[str, Any]:
    """The loss, the groups' slopes and the deferred checks in one host read."""
    tensors = [loss.detach().reshape(())]
    for result in steps:
        tensors.append(loss.new_zeros(()) if result is None else result.slope)
        tensors.append(loss.new_zeros(()) if result is None else result.curvature)
    extra = [deferred.ignored_targets, deferred.model_output_finite]
    tensors += [t for t in extra if t is not None]
    device = loss.device
    values = torch.stack(
        [t.detach().reshape(()).to(device=device, dtype=torch.float64) for t in tensors]
    ).tolist()
    count = len(steps)
    rest = values[1 + 2 * count :]
    ignored = rest.pop(0) if deferred.ignored_targets is not None else 0.0
    output_finite = rest.pop(0) if deferred.model_output_finite is not None else 1.0
    return {
        "loss": values[0],
        "slopes": values[1 : 1 + 2 * count : 2],
        "curvatures": values[2 : 2 + 2 * count : 2],
        "ignored": int(ignored),
        "output_finite": bool(output_finite),
    }


def _problem(
    values: dict[str, Any], loss: Tensor, deferred: DeferredChecks
) -> str | None:
    if values["ignored"]:
        from dampednewton.backpack.loss_checks import ignored_targets_error

        raise ignored_targets_error(
            values["ignored"], deferred.num_targets, deferred.ignore_index
        )
    if not math.isfinite(values["loss"]):
        return f"the loss is {values['loss']}"
    if not values["output_finite"]:
        return (
            "the model output is not finite, so the loss Hessian cannot be sampled "
            "(Monte-Carlo GGN)"
        )
    if not all(math.isfinite(v) for v in values["slopes"] + values["curvatures"]):
        return "the damped Newton step is not finite"
    return None


def _trust_scale(option: GroupOptions, slope: float) -> float:
    """``ν = min(1, √(2κ / (lr² (−ḡᵀs))))`` on the host (``1``: no trust region)."""
    if option.kl_clip is None or option.lr == 0 or slope >= 0:
        return 1.0
    bound = 2 * option.kl_clip / option.lr**2
    return min(1.0, math.sqrt(bound / -slope))


def _apply(
    result: KroneckerGroupStep, option: GroupOptions, state: Any, scale: float
) -> None:
    """Move a group's parameters by ``lr·ν·s`` (momentum and weight decay included)."""
    with torch.no_grad():
        pairs = [(p, d) for p, d in result.directions if p.requires_grad]
        plain = option.momentum == 0 and option.weight_decay == 0
        if plain and all(d.dtype == p.dtype for p, d in pairs):
            torch._foreach_add_(
                [p for p, _ in pairs],
                [d for _, d in pairs],
                alpha=option.lr * scale,
            )
            return
        for param, direction in pairs:
            update_parameter(
                param,
                (direction * scale).to(computation_dtype(param.dtype)),
                state[param],
                option,
            )
