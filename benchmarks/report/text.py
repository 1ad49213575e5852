"""Numbers and settings as the report writes them."""

from __future__ import annotations

import math
from typing import Any


def format_number(value: float, digits: int = 4) -> str:
    """Compact number, ``—`` for NaN."""
    return "—" if not math.isfinite(value) else f"{value:.{digits}g}"


def format_pm(mean: float, std: float, digits: int = 4) -> str:
    """``mean ± std``."""
    if not math.isfinite(mean):
        return "—"
    return f"{format_number(mean, digits)} ± {format_number(std, 2)}"


def format_value(value: Any) -> str:
    """A hyperparameter value for the table."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def format_hyperparameters(hyperparameters: dict[str, Any]) -> str:
    """``lr=0.1, damping=0.01``."""
    return ", ".join(f"{k}={format_value(v)}" for k, v in hyperparameters.items())
