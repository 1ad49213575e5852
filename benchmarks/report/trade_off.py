"""The report's trade-off paragraph: this package's best optimizer against the rest.

For the best ``dampednewton*`` optimizer of a problem, on the hardest target it
reached: its steps and training time to the target against every other optimizer's,
naming the other that took the fewest steps and the one that took the least time,
with the cost of a step against theirs; then the final metrics. Steps and time to a
target follow AlgoPerf's rule
(:func:`benchmarks.report.aggregate.fastest_to_target`: the grid's fastest run, median
over seeds), for every optimizer alike. Every number comes from the sweep's own results.
"""

from __future__ import annotations

import math

from benchmarks.report.aggregate import (
    FastestToTarget,
    Setting,
    Tuned,
    describing_run,
    fastest_to_target,
    step_time_ratio,
)
from benchmarks.report.text import format_hyperparameters, format_number

#: Optimizer names of this package (the trade-off compares them with the others).
PACKAGE_OPTIMIZERS = "dampednewton"


def _compare(theirs: float, ours: float, better: str, worse: str, even: str) -> str:
    """Words for ``theirs / ours``: ``better``/``worse`` formatted with the factor.

    Args:
        theirs: The other optimizer's value (steps, seconds).
        ours: Ours; lower is better.
        better: Text with ``{x}`` for ``theirs / ours > 1``, e.g. ``"{x}× fewer"``.
        worse: Text with ``{x}`` for ``ours / theirs > 1``.
        even: Text for a ratio within 5 % of 1.

    Returns:
        The text, the factor to 2 significant digits (``∞`` where one value is 0:
        a target the initial model met).
    """
    if theirs == ours:
        return even
    if ours == 0 or theirs == 0:
        return (better if ours == 0 else worse).format(x="∞")
    ratio = theirs / ours
    if math.isclose(ratio, 1.0, rel_tol=0.05):
        return even
    if ratio > 1:
        return better.format(x=f"{ratio:.2g}")
    return worse.format(x=f"{1 / ratio:.2g}")


def _grid_point(fastest: FastestToTarget, choice: Tuned) -> str:
    """`` (lr=0.1)``: the varied settings of the fastest run's grid point."""
    if fastest.setting is None or not choice.grid:
        return ""
    values = {key: fastest.setting.hyperparameters.get(key) for key in choice.grid}
    return f" ({format_hyperparameters(values)})"


def _figures(choice: Tuned, index: int) -> tuple[FastestToTarget, FastestToTarget]:
    """AlgoPerf's steps and seconds of one optimizer to target ``index``."""
    return (
        fastest_to_target(choice.candidates, "steps_to_target", index),
        fastest_to_target(choice.candidates, "time_to_target", index),
    )


def _seed_note(fastest: FastestToTarget) -> str:
    """`` (2/3 seeds)`` when some seed never reached the target."""
    if fastest.seeds_reached == fastest.seeds:
        return ""
    return f" ({fastest.seeds_reached}/{fastest.seeds} seeds)"


def trade_off(
    problem: str, tuned: dict[str, Tuned], settings: list[Setting]
) -> str | None:
    """One paragraph: the package's steps and time to a target against every other's.

    Compares the best tuned ``dampednewton*`` optimizer (best final test metric) with
    the other optimizers of the sweep on ``problem``: on the hardest target it
    reached, its steps and training time against each other's, naming the fewest
    steps and the least time among the others (AlgoPerf's rule for all: the grid's
    fastest run, median over seeds), with its time per step against theirs; and its
    final test metric against the best other's.

    Args:
        problem: Problem name.
        tuned: Optimizer name → tuned setting on this problem.
        settings: All settings of the sweep (for the per-step-time ratio).

    Returns:
        The paragraph, or ``None`` if the sweep has no ``dampednewton*`` optimizer
        or no other one on the problem.
    """
    ours = {o: t for o, t in tuned.items() if o.startswith(PACKAGE_OPTIMIZERS)}
    others = {o: t for o, t in tuned.items() if o not in ours}
    if not ours or not others:
        return None
    name, choice = max(ours.items(), key=lambda item: item[1].best.score())
    rival_name, rival = max(others.items(), key=lambda item: item[1].best.score())
    first = describing_run(r for t in tuned.values() for r in t.best.runs)
    metric, targets = first.metric or "metric", first.targets
    final, _ = choice.best.final("test_metric")
    rival_final, _ = rival.best.final("test_metric")
    ending = (
        f"Final test {metric}: {format_number(final)} ({name} tuned) against "
        f"{format_number(rival_final)} for {rival_name}, the best other optimizer."
    )
    reached = [i for i in range(len(targets)) if _figures(choice, i)[0].reached]
    # A target the initial model meets (0 steps: every optimizer starts from it)
    # says nothing; the hardest one it had to train for does.
    trained = [i for i in reached if _figures(choice, i)[0].value > 0]
    if not reached:
        cost = step_time_ratio(settings, problem, name, rival_name)
        return (
            f"On {problem}, {name} reached no target "
            f"({', '.join(f'{t:g}' for t in targets)}) on the median seed, and one "
            f"step costs {format_number(cost, 2)}× one {rival_name} step. " + ending
        )
    index = (trained or reached)[-1]
    steps, seconds = _figures(choice, index)
    lead = (
        f"On {problem}, {name} reached test {metric} {targets[index]:g} in "
        f"{steps.value:.0f} steps{_grid_point(steps, choice)}{_seed_note(steps)} "
        f"and {seconds.value:.2g} s of training{_grid_point(seconds, choice)} (the "
        "grid's fastest run, median over seeds, for every optimizer)"
    )
    figures = {o: _figures(t, index) for o, t in others.items()}
    contenders = {o: f for o, f in figures.items() if f[0].reached}
    if not contenders:
        cost = step_time_ratio(settings, problem, name, rival_name)
        return (
            f"{lead}; no other optimizer reached it. One {name} step costs "
            f"{format_number(cost, 2)}× one {rival_name} step. {ending}"
        )
    fewest = min(contenders, key=lambda o: contenders[o][0].value)
    soonest = min(contenders, key=lambda o: contenders[o][1].value)
    fewest_steps, soonest_seconds = contenders[fewest][0], contenders[soonest][1]
    in_steps = _compare(
        fewest_steps.value,
        steps.value,
        "{x}× fewer steps",
        "{x}× more steps",
        "as many steps",
    )
    in_time = _compare(
        soonest_seconds.value,
        seconds.value,
        "{x}× sooner",
        "{x}× later",
        "at about the same time",
    )
    costs = " and ".join(
        f"{format_number(step_time_ratio(settings, problem, name, o), 2)}× one {o} step"
        for o in dict.fromkeys((fewest, soonest))
    )
    each = "; ".join(
        f"{o} {s.value:.0f} steps, {t.value:.2g} s"
        if s.reached
        else f"{o} not reached{_seed_note(s)}"
        for o, (s, t) in sorted(figures.items(), key=lambda item: item[1][1].value)
    )
    return (
        f"{lead}. Fewest steps among the others: {fewest}, {fewest_steps.value:.0f} "
        f"steps{_grid_point(fewest_steps, others[fewest])}: {name} took "
        f"{in_steps}. Least time among the others: {soonest}, "
        f"{soonest_seconds.value:.2g} s{_grid_point(soonest_seconds, others[soonest])}"
        f": {name} got there {in_time}. One {name} step costs {costs}. Every "
        f"other optimizer, by time: {each}. {ending}"
    )
