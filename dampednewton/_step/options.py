"""The optimizer's options: validated in one place, with one exception policy.

Every hyperparameter of :class:`~dampednewton.DampedNewton` lives in its param groups
(dicts, as ``torch.optim`` wants them). :class:`GroupOptions` is one group's options,
checked and converted to typed values (shorthand numbers to policies);
:class:`SharedOptions` are those that shape the single backward pass and must agree
across groups. A value of the wrong type raises ``TypeError``, a value of the right
type outside its range ``ValueError``; every message says what is accepted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dampednewton.averaging import CurvatureAveraging
from dampednewton.distributed import Communicator
from dampednewton.policies.basis import (
    Basis,
    KroneckerBasis,
    as_basis,
    check_kronecker_damping,
)
from dampednewton.policies.checks import (
    check_integer,
    check_kl_clip,
    check_newton_fraction,
    check_number,
    check_subsampling,
    check_warn_small_eigvals,
)
from dampednewton.policies.complement import ComplementPolicy, as_complement
from dampednewton.policies.criteria import Criterion, as_criterion
from dampednewton.policies.damping import (
    AdaptiveDamping,
    Damping,
    as_damping,
    needs_sample_statistics,
)
from dampednewton.policies.schedule_free import ScheduleFree
from dampednewton.process_groups import resolve_process_group

NONFINITE_MODES = ("raise", "skip")
SHARED_SETTINGS = ("mc_samples", "subsampling_ggn", "subsampling_grad")


def check_nonfinite(mode: Any) -> str:
    """Check the non-finite policy: ``'raise'`` or ``'skip'``.

    Args:
        mode: The policy.

    Returns:
        The policy.

    Raises:
        ValueError: For anything else.
    """
    if mode not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be 'raise' or 'skip', got {mode!r}.")
    return mode


def check_process_group(process_group: Any, monitor: Any) -> Communicator | None:
    """Check the data-parallel process group; its communicator, if distributed.

    Args:
        process_group: ``None`` (the ``torch.distributed`` world group when it is
            initialized) or a process group.
        monitor: The optimizer's diagnostics monitor, or ``None``.

    Returns:
        The communicator; ``None`` for a single process.

    Raises:
        TypeError: For anything but ``None`` or a process group.
        ValueError: For a diagnostics monitor of another process group (its records
            would describe another batch than the step's).
    """
    communicator = resolve_process_group(process_group)
    if monitor is None:
        return communicator
    group = None if communicator is None else communicator.group
    monitor_group = None if monitor.communicator is None else monitor.communicator.group
    if monitor_group is not group:
        raise ValueError(
            "The diagnostics monitor must describe the optimizer's global batch: "
            "create it with the same process_group as DampedNewton (both None: the "
            "torch.distributed world group when initialized, so create both after "
            "init_process_group)."
        )
    return communicator


@dataclass(frozen=True)
class SharedOptions:
    """Options of the single backward pass, the same in every group.

    Attributes:
        mc_samples: ``0`` for the exact GGN, else Monte-Carlo samples.
        subsampling_ggn: Sample indices for directions and curvatures, or ``None``.
        subsampling_grad: Sample indices for the directional gradients, or ``None``.
    """

    mc_samples: int
    subsampling_ggn: list[int] | None
    subsampling_grad: list[int] | None
    kronecker: bool = False

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> SharedOptions:
        """Validate one group's shared options.

        Args:
            group: A param group.

        Returns:
            The checked options.
        """
        return cls(
            mc_samples=check_integer("mc_samples", group["mc_samples"], 0),
            subsampling_ggn=check_subsampling(
                group["subsampling_ggn"], "subsampling_ggn"
            ),
            subsampling_grad=check_subsampling(
                group["subsampling_grad"], "subsampling_grad"
            ),
            kronecker=isinstance(as_basis(group["basis"]), KroneckerBasis),
        )

    @classmethod
    def from_groups(cls, groups: Sequence[Mapping[str, Any]]) -> SharedOptions:
        """The shared options of all groups, checked to agree.

        Args:
            groups: The param groups (at least one).

        Returns:
            The first group's shared options.

        Raises:
            ValueError: If a group's shared option differs from the first group's,
                the groups mix bases, or ``subsampling_grad`` is given where every
                group averages its curvature (no group would use it).
        """
        first = cls.from_group(groups[0])
        if first.kronecker and first.subsampling_grad is not None:
            raise ValueError(
                "subsampling_grad selects the samples of the Gram basis' directional "
                "gradients; the Kronecker basis steps with the mean gradient of the "
                "whole batch. Leave subsampling_grad=None (subsampling_ggn selects "
                "the samples of the Kronecker factors)."
            )
        for group in groups[1:]:
            other = cls.from_group(group)
            if other.kronecker != first.kronecker:
                raise ValueError(
                    "All parameter groups need the same kind of basis (one backward "
                    f"pass serves all): {groups[0]['basis']!r} vs {group['basis']!r}. "
                    "Use KroneckerBasis() in every group, or GramBasis() in every "
                    "group."
                )
            for key in SHARED_SETTINGS:
                if getattr(other, key) != getattr(first, key):
                    raise ValueError(
                        f"'{key}' must be the same in all parameter groups (one "
                        f"backward pass serves all): {groups[0][key]!r} vs "
                        f"{group[key]!r}."
                    )
        if first.subsampling_grad is not None and all(
            group.get("averaging") is not None for group in groups
        ):
            raise ValueError(
                "subsampling_grad selects the samples of the directional gradients "
                "of ViViT's step (averaging=None); with curvature averaging (the Gram "
                "basis' default) every group steps with the whole batch's mean "
                "gradient. Pass averaging=None for ViViT's step, or leave "
                "subsampling_grad=None."
            )
        return first


@dataclass(frozen=True)
class GroupOptions:
    """One param group's hyperparameters, checked and with shorthands resolved.

    Attributes:
        lr: Learning rate ``>= 0``.
        basis: The directions' basis (:mod:`dampednewton.policies.basis`).
        damping: The damping policy (a number became :class:`ConstantDamping`).
        criterion: The criterion (an int ``k`` became :class:`TopK`).
        complement: The complement's curvature policy, or ``None``.
        newton_fraction: Fraction ``φ ∈ (0, 1]`` of the damped Newton step taken
            along the kept directions.
        averaging: Curvature averaging, or ``None``.
        kl_clip: Trust-region radius ``> 0``, or ``None``.
        momentum: Heavy-ball momentum in ``[0, 1)``, or Schedule-Free averaging.
        nesterov: Nesterov's variant (needs ``momentum > 0``).
        weight_decay: Decoupled weight decay ``>= 0``.
        warn_small_eigvals: Threshold of the small-eigenvalue warning ``>= 0``.
    """

    lr: float
    basis: Basis
    damping: Damping
    criterion: Criterion
    complement: ComplementPolicy | None
    newton_fraction: float
    averaging: CurvatureAveraging | None
    kl_clip: float | None
    momentum: float | ScheduleFree
    nesterov: bool
    weight_decay: float
    warn_small_eigvals: float

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> GroupOptions:
        """Validate a param group.

        Args:
            group: A param group with every hyperparameter.

        Returns:
            The checked options.

        Raises:
            TypeError: For a value of the wrong type.
            ValueError: For a value outside its range, or averaging with a damping
                policy that needs per-sample statistics.
        """
        lr = group["lr"]
        lr = check_number("lr", lr.item() if isinstance(lr, Tensor) else lr)
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"Invalid learning rate {group['lr']!r}: must be >= 0.")
        basis = as_basis(group["basis"])
        damping = as_damping(group["damping"])
        if isinstance(basis, KroneckerBasis):
            check_kronecker_damping(damping)
        criterion = as_criterion(group["criterion"])
        SharedOptions.from_group(group)  # checked with the group (a loaded one too)
        warn_small_eigvals = check_warn_small_eigvals(group["warn_small_eigvals"])
        complement = as_complement(group["complement"])
        newton_fraction = check_newton_fraction(group["newton_fraction"])
        averaging = _checked_averaging(group["averaging"], damping)
        kl_clip = check_kl_clip(group["kl_clip"])
        momentum = _checked_momentum(group["momentum"])
        weight_decay = check_number("weight_decay", group["weight_decay"])
        nesterov = group["nesterov"]
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be True or False, got {nesterov!r}.")
        if nesterov and (isinstance(momentum, ScheduleFree) or momentum == 0):
            raise ValueError(
                "nesterov=True needs a heavy-ball momentum > 0 (not ScheduleFree)."
            )
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}.")
        return cls(
            lr=lr,
            basis=basis,
            damping=damping,
            criterion=criterion,
            complement=complement,
            newton_fraction=newton_fraction,
            averaging=averaging,
            kl_clip=kl_clip,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            warn_small_eigvals=warn_small_eigvals,
        )

    @functools.cached_property
    def adaptive_damping(self) -> AdaptiveDamping | None:
        """The damping policy if it adapts after each step, else ``None``.

        Cached: the protocol check costs more than a step between refreshes.
        """
        return self.damping if isinstance(self.damping, AdaptiveDamping) else None


def _checked_momentum(momentum: Any) -> float | ScheduleFree:
    if isinstance(momentum, ScheduleFree):
        return momentum
    momentum = check_number("momentum", momentum)
    if not 0 <= momentum < 1:
        raise ValueError(
            f"momentum must be in [0, 1) or a ScheduleFree(...), got {momentum!r}."
        )
    return momentum


def _checked_averaging(averaging: Any, damping: Damping) -> CurvatureAveraging | None:
    if averaging is None:
        return None
    if not isinstance(averaging, CurvatureAveraging):
        raise TypeError(
            "averaging must be None or a CurvatureAveraging(decay=..., rank=..., "
            f"interval=...), got {type(averaging).__name__}."
        )
    if needs_sample_statistics(damping):
        raise ValueError(
            "averaging needs a damping policy that uses mean slopes only (a number, "
            "ConstantDamping, RelativeDamping, LevenbergMarquardt or another "
            "MeanStatisticsDamping): the averaged directions have no per-sample "
            f"statistics, got {type(damping).__name__}."
        )
    return averaging


class ValidatedGroups:
    """The groups' validated options, validated again only when a value changes.

    A step validates every group (``torch.optim`` users and schedulers edit the
    dicts between steps); the checks of the policies' protocols cost more than a
    step between refreshes. Numbers, strings and sequences are compared by value,
    policies by identity (their validated type cannot change), tensors never match
    (they may be changed in place).
    """

    def __init__(self) -> None:
        """Start with nothing validated."""
        self._key: tuple | None = None
        self._options: tuple[list[GroupOptions], SharedOptions] | None = None

    def get(
        self, groups: Sequence[Mapping[str, Any]]
    ) -> tuple[list[GroupOptions], SharedOptions]:
        """Every group's options and the shared ones.

        Args:
            groups: The param groups.

        Returns:
            The options of each group and those of the backward pass.
        """
        key = tuple(
            tuple(
                (name, _comparable(value))
                for name, value in group.items()
                if name != "params"
            )
            for group in groups
        )
        if self._options is None or key != self._key:
            options = [GroupOptions.from_group(group) for group in groups]
            self._options = (options, SharedOptions.from_groups(groups))
            self._key = key
        return self._options


def _comparable(value: Any) -> Any:
    """``value`` in a form whose equality says the validated options still hold."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return tuple(_comparable(item) for item in value)
    if isinstance(value, Tensor):
        return object()  # never equal: a tensor may have changed in place
    return (type(value), id(value))


def loss_tolerance(options: Sequence[GroupOptions]) -> float | None:
    """The smallest ``loss_tolerance`` of the averaged groups (``None``: none set)."""
    tolerances = [
        option.averaging.loss_tolerance
        for option in options
        if option.averaging is not None and option.averaging.loss_tolerance is not None
    ]
    return min(tolerances, default=None)
