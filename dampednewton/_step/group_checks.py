"""Checks of a param group as it is added.

Its options are validated (the group is removed again when refused); keys that are no
hyperparameter and options that its basis ignores are warned about.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from dampednewton._step.defaults import BASIS_DEFAULT
from dampednewton._step.options import GroupOptions, SharedOptions
from dampednewton.policies.basis import KroneckerBasis, as_basis
from dampednewton.policies.checks import check_subsampling

# Keys a group may carry besides the hyperparameters: a label, torch's parameter
# names, and the keys torch's LR schedulers (and SWALR) write into the groups.
EXTRA_GROUP_KEYS = (
    "name",
    "param_names",
    "initial_lr",
    "max_lr",
    "min_lr",
    "max_momentum",
    "base_momentum",
    "swa_lr",
)

GRAM_ONLY_OPTIONS = ("criterion", "complement", "newton_fraction")
"""Group options that only the Gram basis reads."""


def warn_ignored_options(
    basis: Any,
    gram_options: Mapping[str, Any],
    averaging: Any = None,
    where: str = "",
    stacklevel: int = 3,
) -> None:
    """Warn about the Gram basis' options given to the Kronecker basis.

    Args:
        basis: The basis they were given with.
        gram_options: ``criterion``, ``complement``, ``newton_fraction`` as given
            (:data:`BASIS_DEFAULT` when not).
        averaging: The group's averaging (its ``rank`` truncates the Gram basis'
            averaged factor only).
        where: Where they were given, e.g. ``" in parameter group 1"``.
        stacklevel: ``warnings.warn``'s, counted from this function.
    """
    if not isinstance(as_basis(basis), KroneckerBasis):
        return
    given = sorted(
        name for name, value in gram_options.items() if value is not BASIS_DEFAULT
    )
    if getattr(averaging, "rank", None) is not None:
        given.append("averaging's rank")
    if given:
        warnings.warn(
            f"Options of the Gram basis' directions ({', '.join(given)}){where} have "
            "no effect with the Kronecker basis (the default): it steps along every "
            "pair of its factors' eigenvectors (their number: KroneckerBasis("
            "rank=..., exact_size=...)). Pass basis=GramBasis() to use them.",
            stacklevel=stacklevel,
        )


def warn_unknown_keys(
    group: Mapping[str, Any], defaults: Mapping[str, Any], where: str, stacklevel: int
) -> None:
    """Warn about group keys that are no hyperparameter of the optimizer.

    As in ``torch.optim`` they stay in the group (e.g. a layer-wise learning-rate
    scale another tool reads); the warning catches a misspelt hyperparameter.

    Args:
        group: A param group as given by the user.
        defaults: The optimizer's defaults (its hyperparameters).
        where: Where the group was given, e.g. ``" in parameter group 1"``.
        stacklevel: ``warnings.warn``'s, counted from this function.
    """
    unknown = set(group) - {"params", *defaults, *EXTRA_GROUP_KEYS}
    if unknown:
        warnings.warn(
            f"Keys {sorted(unknown)}{where} are no hyperparameters of DampedNewton: "
            f"they stay in the group unused (misspelt? it takes {sorted(defaults)}).",
            stacklevel=stacklevel,
        )


def check_listed_once(params: list[Any], index: int) -> None:
    """Refuse a group that lists a parameter twice (it would be stepped twice).

    Args:
        params: The group's parameters.
        index: The group's index.

    Raises:
        ValueError: For a parameter listed twice.
    """
    seen: set[int] = set()
    for param in params:
        if id(param) in seen:
            raise ValueError(
                f"Parameter group {index} lists a parameter of shape "
                f"{tuple(param.shape)} twice; each parameter is stepped once, so list "
                "it once (e.g. list(dict.fromkeys(params)))."
            )
        seen.add(id(param))


def check_added_group(
    param_groups: list[dict[str, Any]],
    defaults: Mapping[str, Any],
    gram_options: Mapping[str, Any],
    stacklevel: int,
) -> None:
    """Validate the group torch just appended (removed again when refused); warn.

    The sub-sampling indices become checked plain lists, read once (an iterator is
    consumed; a Hydra ``ListConfig`` or a ``range`` would not load with
    ``weights_only=True``). Keys that are no hyperparameter and options its basis
    ignores are warned about.

    Args:
        param_groups: The optimizer's groups, the new one last.
        defaults: The optimizer's defaults (its hyperparameters).
        gram_options: The Gram basis' options the group was given.
        stacklevel: The warnings', as ``warnings.warn``'s would be here.

    Raises:
        ValueError: For a parameter listed twice, invalid hyperparameters or shared
            settings that differ from the other groups'.
        TypeError: For hyperparameters of the wrong type.
    """
    group = param_groups[-1]
    try:
        check_listed_once(group["params"], len(param_groups) - 1)
        for key in ("subsampling_ggn", "subsampling_grad"):
            group[key] = check_subsampling(group[key], key)
        GroupOptions.from_group(group)
        SharedOptions.from_groups(param_groups)
    except (ValueError, TypeError):
        param_groups.pop()
        raise
    where = f" in parameter group {len(param_groups) - 1}"
    warn_unknown_keys(group, defaults, where, stacklevel + 1)
    warn_ignored_options(
        group["basis"], gram_options, group["averaging"], where, stacklevel + 1
    )
