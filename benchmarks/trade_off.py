"""The report's trade-off paragraph: this package's best optimizer against the rest.

For the best ``dampednewton*`` optimizer of a problem: the steps it took to the hardest
target it reached against the other optimizer that took the fewest, its time per step
against that one's, the training time to the target, and the final metrics, all from
the sweep's own results.
"""

from __future__ import annotations

import math

from benchmarks.aggregate import Setting, Tuned, step_time_ratio
from benchmarks.text import format_hyperparameters, format_number

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
        The text, the factor to 2 significant digits.
    """
    ratio = theirs / ours
    if math.isclose(ratio, 1.0, rel_tol=0.05):
        return even
    if ratio > 1:
        return better.format(x=f"{ratio:.2g}")
    return worse.format(x=f"{1 / ratio:.2g}")


def trade_off(
    problem: str, tuned: dict[str, Tuned], settings: list[Setting]
) -> str | None:
    """One paragraph: the package's steps-to-target advantage vs its time per step.

    Compares the best tuned ``dampednewton*`` optimizer with the other optimizers of
    the sweep on ``problem``: on the hardest target it reached, with the other that
    reached it in the fewest steps (steps, time per step, training time to it); and
    its final test metric with the best other's. Every number comes from the
    sweep's results.

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
    best = choice.best
    rival_name, rival = max(others.items(), key=lambda item: item[1].best.score())
    first = best.runs[0]
    metric, targets = first.metric or "metric", first.targets
    final, _ = best.final("test_metric")
    rival_final, _ = rival.best.final("test_metric")
    tuned_values = {key: best.hyperparameters.get(key) for key in choice.grid}
    head = f"On {problem}, {name}" + (
        f" ({format_hyperparameters(tuned_values)})" if tuned_values else ""
    )
    ending = (
        f"Final test {metric}: {format_number(final)} against "
        f"{format_number(rival_final)} for {rival_name}, the best other optimizer."
    )
    reached = [
        i for i in range(len(targets)) if best.to_target("steps_to_target", i)[2]
    ]
    if not reached:
        cost = step_time_ratio(settings, problem, name, rival_name)
        return (
            f"{head} reached no target ({', '.join(f'{t:g}' for t in targets)}) "
            f"on any seed, and one step costs {format_number(cost, 2)}× one "
            f"{rival_name} step. " + ending
        )
    index = reached[-1]
    steps, _, seeds = best.to_target("steps_to_target", index)
    seconds, _, _ = best.to_target("time_to_target", index)
    of_seeds = "" if seeds == len(best.runs) else f" ({seeds}/{len(best.runs)} seeds)"
    lead = (
        f"{head} reached test {metric} {targets[index]:g} in {steps:.0f} steps"
        f"{of_seeds} ({seconds:.2g} s of training)"
    )
    contenders = {
        o: t.best.to_target("steps_to_target", index)[0]
        for o, t in others.items()
        if t.best.to_target("steps_to_target", index)[2]
    }
    if not contenders:
        cost = step_time_ratio(settings, problem, name, rival_name)
        return (
            f"{lead}; no other optimizer reached it. One {name} step costs "
            f"{format_number(cost, 2)}× one {rival_name} step. {ending}"
        )
    fastest = min(contenders, key=contenders.__getitem__)
    fastest_steps = contenders[fastest]
    fastest_seconds, _, _ = others[fastest].best.to_target("time_to_target", index)
    cost = step_time_ratio(settings, problem, name, fastest)
    in_steps = _compare(
        fastest_steps, steps, "{x}× fewer steps", "{x}× more steps", "as many steps"
    )
    in_time = _compare(
        fastest_seconds, seconds, "{x}× sooner", "{x}× later", "at about the same time"
    )
    return (
        f"{lead}, {fastest} (the fewest steps among the others) in "
        f"{fastest_steps:.0f} steps: {in_steps}. One {name} step costs "
        f"{format_number(cost, 2)}× one {fastest} step, so in training time it got "
        f"there {in_time} ({seconds:.2g} s against {fastest_seconds:.2g} s). {ending}"
    )
