"""Read a sweep's ``result.json`` files.

In job order (2 before 10), damaged files named and left out, and a problem's runs
told apart by name where their problem or machine settings differ.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.sweep.result import RESULT_FILE, RunResult


def load_results(sweep_dir: Path) -> list[RunResult]:
    """Read every ``result.json`` below ``sweep_dir`` (skipped jobs left out).

    Args:
        sweep_dir: A Hydra sweep (or run) directory.

    Returns:
        The results (``job_dir`` set), sorted by job directory.

    Raises:
        FileNotFoundError: If there is no result file.
    """
    paths = sorted(Path(sweep_dir).rglob(RESULT_FILE), key=job_order)
    if not paths:
        raise FileNotFoundError(
            f"No {RESULT_FILE} below {sweep_dir}: run `python -m benchmarks.run "
            "--multirun ...` first, or pass the sweep directory it printed."
        )
    results = []
    for path in paths:
        try:
            results.append(RunResult.read(path))
        except (ValueError, KeyError, TypeError) as error:  # cut short, edited
            warnings.warn(
                f"Left out {path}, which is damaged ({type(error).__name__}: "
                f"{error}); rerun the sweep to redo that job.",
                stacklevel=2,
            )
    ran = [result for result in results if result.status != "skipped"]
    if not ran:
        reasons = sorted({r.skip_reason or "?" for r in results})
        raise FileNotFoundError(
            f"No job below {sweep_dir} ran: every readable {RESULT_FILE} is of a "
            f"skipped job ({'; '.join(reasons)})."
        )
    return distinguish_protocols(ran)


def job_order(path: Path) -> tuple:
    """Sort key of a result file: job folders by number (2 before 10), then name."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in path.parent.parts
    )


PROTOCOL_KEYS = ("dtype", "device", "num_threads")
"""The config's settings besides the problem's that make runs incomparable (data
parallelism does not: its ranks take the global batch's step, and the report shows
each setting's world sizes)."""


def _protocol(result: RunResult) -> dict[str, str]:
    """What a run measured besides the optimizer: problem settings and machine."""
    config = result.config or {}
    flat = {
        name: json.dumps(value, sort_keys=True)
        for name, value in _flattened(config.get("problem") or {}).items()
    }
    flat.update({key: json.dumps(config.get(key)) for key in PROTOCOL_KEYS})
    return flat


def _flattened(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def distinguish_protocols(results: Sequence[RunResult]) -> list[RunResult]:
    """Name each problem's runs by the settings in which they differ, if any.

    A sweep over a problem setting (``problem.batch_size=8,256``) or the machine's
    (``num_threads=1,2``) measures different problems: their runs must not average
    as seeds of one setting. Their problem's name gets the differing settings, e.g.
    ``digits_logreg (batch_size=8)``.

    Args:
        results: Loaded results.

    Returns:
        The results, renamed where their problem's runs differ, in the same order.
    """
    protocols = [_protocol(result) for result in results]
    varying: dict[str, list[str]] = {}
    for name in dict.fromkeys(result.problem for result in results):
        mine = [p for r, p in zip(results, protocols, strict=True) if r.problem == name]
        keys = sorted({key for protocol in mine for key in protocol})
        varying[name] = [key for key in keys if len({p.get(key) for p in mine}) > 1]
    named = []
    for result, protocol in zip(results, protocols, strict=True):
        keys = varying[result.problem]
        if keys:
            settings = ", ".join(
                f"{key}={json.loads(protocol.get(key, 'null'))}" for key in keys
            )
            result = dataclasses.replace(
                result, problem=f"{result.problem} ({settings})"
            )
        named.append(result)
    return named


def latest_sweep(root: Path = Path("multirun")) -> Path:
    """The newest sweep directory (by modification time) holding results."""
    candidates = {p.parent.parent for p in root.rglob(RESULT_FILE)}
    if not candidates:
        raise FileNotFoundError(
            f"No sweep with results under {root.resolve()}: run `python -m "
            "benchmarks.run --multirun +sweep=default` first."
        )
    return max(candidates, key=lambda p: p.stat().st_mtime)
