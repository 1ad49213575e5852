"""The options tuned for each basis, and the marker of a basis-dependent default.

The defaults were chosen by time to target on the benchmark problems
(docs/benchmarks.md); :class:`~dampednewton.DampedNewton` fills the options left at
:data:`BASIS_DEFAULT` from :func:`basis_defaults` of its basis.
"""

from __future__ import annotations

from typing import Any

from dampednewton.averaging import CurvatureAveraging
from dampednewton.policies.basis import Basis, KroneckerBasis, as_basis
from dampednewton.policies.complement import SmallestCurvature
from dampednewton.policies.damping import LevenbergMarquardt

DEFAULT_DAMPING = 0.1
"""Initial ``δ`` of the Gram basis' default Levenberg-Marquardt damping."""
DEFAULT_DAMPING_INTERVAL = 5
"""Updates between adaptations of that damping (K-FAC's T₃); the optimizer updates it
on the steps that refresh the curvature (every step without averaging)."""


class _BasisDefault:
    """The marker of an option whose default depends on the basis."""

    def __repr__(self) -> str:
        return "<the basis' default>"


BASIS_DEFAULT: Any = _BasisDefault()
"""Default of ``newton_fraction``, ``averaging``, ``kl_clip``, ``momentum`` and
``weight_decay`` (the value of :func:`basis_defaults` for the constructor's
``basis``), and of the Gram basis' ``criterion`` and ``complement`` (so that the
Kronecker basis can warn about them when given)."""


def basis_defaults(basis: Basis) -> dict[str, Any]:
    """The options tuned for a basis (by time to target; see docs/benchmarks.md).

    Args:
        basis: :class:`KroneckerBasis` or :class:`GramBasis`.

    Returns:
        ``damping``, ``newton_fraction``, ``averaging``, ``kl_clip``,
        ``momentum`` and ``weight_decay`` (new policy objects on every call).
    """
    if isinstance(as_basis(basis), KroneckerBasis):
        return {
            "damping": 3e-3,
            "newton_fraction": 1.0,
            "averaging": CurvatureAveraging(decay=0.95, interval=15),
            "kl_clip": 1e-3,
            "momentum": 0.5,
            "weight_decay": 1e-3,
        }
    return {
        "damping": LevenbergMarquardt(
            value=DEFAULT_DAMPING, interval=DEFAULT_DAMPING_INTERVAL
        ),
        "newton_fraction": 0.3,
        "averaging": CurvatureAveraging(),
        "kl_clip": 1.0,
        "momentum": 0.0,
        "weight_decay": 0.0,
    }


def filled_defaults(basis: Basis, options: dict[str, Any]) -> dict[str, Any]:
    """The constructor's options with every basis-dependent default filled in.

    Args:
        basis: The constructor's basis.
        options: Options as given, :data:`BASIS_DEFAULT` (``damping``: ``None``)
            where left to the basis.

    Returns:
        The options in the same order: the basis' tuned values
        (:func:`basis_defaults`) and the Gram basis' ``criterion`` 20 and
        ``complement`` :class:`~dampednewton.policies.SmallestCurvature` filled in.
    """
    tuned = {
        **basis_defaults(basis),
        "criterion": 20,
        "complement": SmallestCurvature(),
    }
    return {
        key: tuned[key]
        if value is BASIS_DEFAULT or (key == "damping" and value is None)
        else value
        for key, value in options.items()
    }
