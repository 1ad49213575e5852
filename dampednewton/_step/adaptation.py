"""Adaptive damping: a step's reduction ratio, fed once to every policy object.

``ρ = (L(θ + Δθ) − L(θ)) / q`` with the quadratic model ``q`` of the damped Newton
steps taken (``lr`` and trust-region scaled, summed over groups; the complement's
term included, momentum and weight decay not, see
:mod:`dampednewton._step.quadratic_model`). The loss after the step comes from
calling the closure again, outside the BackPACK context, on the same batch. A policy
object shared by several groups (torch copies the default into every group) is
updated once. An object adapts the damping of one optimizer only (:func:`claim`):
shared by two, each would move the other's ``δ`` by its own steps.
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.guard import STACKLEVEL_OF_CALLER
from dampednewton._step.quadratic_model import StepModel, predicted_change
from dampednewton.backpack.backward import quiet_backward_hook_warning
from dampednewton.policies.damping import AdaptiveDamping


def distinct_adaptive(
    policies: Iterable[AdaptiveDamping | None],
) -> list[AdaptiveDamping]:
    """The adaptive policies of the groups, each object once.

    Args:
        policies: Every group's adaptive damping policy (``None``: not adaptive),
            i.e. ``GroupOptions.adaptive_damping``.

    Returns:
        The distinct objects, in group order.
    """
    distinct = {id(policy): policy for policy in policies if policy is not None}
    return list(distinct.values())


# id(policy) → (the policy, the pipeline that adapts it), both weakly referenced.
_ADAPTED_BY: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}


def claim(policies: Iterable[AdaptiveDamping], owner: object) -> None:
    """Record ``owner`` as the one that adapts each policy; refuse another's policy.

    Policies that cannot be weakly referenced go unchecked. A policy that an earlier
    optimizer adapted continues from its state, with a warning.

    Args:
        policies: Distinct adaptive policies (:func:`distinct_adaptive`).
        owner: The optimizer's pipeline.

    Raises:
        ValueError: If a policy is adapted by another optimizer that is still alive.
    """
    for policy in policies:
        entry = _ADAPTED_BY.get(id(policy))
        if entry is not None and entry[0]() is policy:
            other = entry[1]()
            if other is owner:
                continue
            if other is not None:
                gc.collect()  # an optimizer replaced but not yet collected frees it
                other = entry[1]()
            if other is not None:
                name = type(policy).__name__
                raise ValueError(
                    f"This {name} object already adapts the damping of another "
                    "DampedNewton optimizer, which would move its δ by this one's "
                    f"steps. Give each optimizer its own (a new {name}(...) or "
                    "copy.deepcopy(damping)); the groups of one optimizer may share "
                    "one."
                )
        try:
            policy_ref = weakref.ref(policy)
        except TypeError:
            continue
        if entry is not None and entry[0]() is policy:
            warnings.warn(
                f"This {type(policy).__name__} object was adapted by an earlier "
                f"DampedNewton optimizer ({policy}): this one continues from its "
                "state. For a fresh start pass a new one (with Hydra: instantiate "
                "the optimizer's config anew rather than calling a stored partial).",
                stacklevel=STACKLEVEL_OF_CALLER + 1,
            )
        _ADAPTED_BY[id(policy)] = (policy_ref, weakref.ref(owner))
        weakref.finalize(policy, _ADAPTED_BY.pop, id(policy), None)


def adapt(
    policies: Sequence[AdaptiveDamping],
    closure: Callable[[], Tensor],
    loss: Tensor,
    steps: Iterable[tuple[Tensor | float, StepModel | None]],
    mean_over_ranks: Callable[[float], float] | None = None,
) -> float:
    """Update every policy once with the reduction ratio of the step taken.

    Args:
        policies: Distinct adaptive policies (:func:`distinct_adaptive`).
        closure: Evaluates the loss at the new parameters (its backward is unused).
        loss: The loss before the step.
        steps: Per group, the multiple ``lr·ν`` of its direction and the direction
            (``None``: no step).
        mean_over_ranks: Under data parallelism, the ranks' mean of a number: the
            loss after the step is the global batch's (``loss`` already is).

    Returns:
        The ratio (NaN when no policy needed it or nothing was predicted, ``−∞`` for
        a non-finite loss after the step).
    """
    ratio = math.nan
    if any(policy.ratio_needed() for policy in policies):
        predicted = [
            predicted_change(scale, result.slope, result.curvature)
            for scale, result in steps
            if result is not None
        ]
        with torch.enable_grad(), quiet_backward_hook_warning():
            new_loss = closure().detach()
        # One host read: both losses and every group's predicted change.
        new_value, old_value, *changes = torch.stack(
            [
                t.to(device=new_loss.device, dtype=torch.float64)
                for t in (new_loss, loss.detach(), *predicted)
            ]
        ).tolist()
        predicted_total = sum(changes)
        if mean_over_ranks is not None:
            new_value = mean_over_ranks(new_value)
        if not math.isfinite(new_value):
            ratio = -math.inf
        elif predicted_total != 0:
            ratio = (new_value - old_value) / predicted_total
    for policy in policies:
        policy.update(ratio)
    return ratio
