"""Report of a sweep: CSV of all runs, Markdown tables, PNG plots.

Written into ``<sweep dir>/report`` automatically at the end of every multirun (Hydra
callback); run it by hand to regenerate::

    python -m benchmarks.report [SWEEP_DIR]   # default: the newest one under multirun/
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from benchmarks.report.aggregate import (
    Setting,
    Tuned,
    describing_run,
    fastest_to_target,
    group_settings,
    step_time_ratio,
    tune,
)
from benchmarks.report.loading import latest_sweep, load_results
from benchmarks.report.plots import (
    numeric_grid,
    plot_curves,
    plot_sensitivity,
    plot_step_cost,
)
from benchmarks.report.runs_csv import write_csv
from benchmarks.report.text import (
    format_hyperparameters,
    format_number,
    format_pm,
    format_value,
)
from benchmarks.report.trade_off import trade_off

REPORT_DIR = "report"
NOTES = (
    "Tuned = best mean final test metric over seeds; settings where a seed diverged "
    "(non-finite loss, train loss above the blow-up factor times its initial value, or "
    "final accuracy near chance) or failed rank last; ⚠ marks a tuned value still on "
    "the edge of its grid after the grid extension, which adds points half a decade "
    "beyond an edge (marked 'extended from edge'). Best test metric: the best "
    "evaluation of each seed. Steps/time to a target: mean ± std over the seeds that "
    "reached it "
    "(resolution: the evaluation interval); time excludes evaluation. ms/step: median "
    "after warm-up over the runs of the tuned setting; × sgd: ratio of the medians "
    "over all runs of the optimizer and of sgd on the problem."
)
EXTENDED = "extended from edge"


def _tuned_cell(choice: Tuned) -> str:
    """Tuned values of the varied hyperparameters, ⚠ on a grid edge."""
    parts = []
    for key in choice.grid:
        edge = choice.edges.get(key)
        flag = f" ⚠ {edge} of grid" if edge else ""
        parts.append(
            f"{key}={format_value(choice.best.hyperparameters.get(key))}{flag}"
        )
    extended = f" ({EXTENDED})" if choice.best.extended_from else ""
    return (", ".join(parts) or "(not tuned)") + extended


def _grid_values(choice: Tuned, key: str) -> str:
    """The values tried for ``key``, those added by the grid extension marked."""
    added = {
        json.dumps(s.hyperparameters[key])
        for s in choice.candidates
        if (s.extended_from or {}).get("key") == key
    }
    return ", ".join(
        format_value(v) + (f" ({EXTENDED})" if json.dumps(v) in added else "")
        for v in choice.grid[key]
    )


def _divergence_lines(settings: list[Setting]) -> list[str]:
    """One line per setting with a diverged seed: how many, and why."""
    lines = []
    for setting in settings:
        diverged = setting.divergences()
        if not diverged:
            continue
        values = format_hyperparameters(setting.hyperparameters)
        reasons = "; ".join(f"seed {seed}: {reason}" for seed, reason in diverged)
        lines.append(
            f"- {setting.optimizer} {values}: {len(diverged)}/{len(setting.runs)} "
            f"seed(s) diverged ({reasons})"
        )
    return lines


def _target_cell(setting: Setting, key: str, index: int, seeds: int) -> str:
    """``mean ± std (reached/seeds)`` of steps or seconds to one target."""
    mean, std, reached = setting.to_target(key, index)
    if reached == 0:
        return f"— (0/{seeds})"
    return f"{format_pm(mean, std, 3)} ({reached}/{seeds})"


def _fastest_cell(choice: Tuned, key: str, index: int) -> str:
    """AlgoPerf's steps or seconds to one target, its grid point, seeds that reached."""
    fastest = fastest_to_target(choice.candidates, key, index)
    seeds = f"{fastest.seeds_reached}/{fastest.seeds}"
    if not fastest.reached or fastest.setting is None:
        return f"— ({seeds})"
    values = {k: fastest.setting.hyperparameters.get(k) for k in choice.grid}
    where = f"{format_hyperparameters(values)}, " if values else ""
    return f"{format_number(fastest.value, 3)} ({where}{seeds})"


def _fastest_table(tuned: dict[str, Tuned], targets: list[float]) -> list[str]:
    """Lines of the table of the grid's fastest runs to each target (AlgoPerf)."""
    pairs = [(f"steps to {t:g}", f"time to {t:g} [s]") for t in targets]
    columns = ["optimizer", *(column for pair in pairs for column in pair)]
    lines = [
        "The grid's fastest run to each target (AlgoPerf's rule: each seed's "
        "fastest grid point, median over seeds; its grid point, seeds that reached "
        "the target):",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for optimizer, choice in tuned.items():
        cells = [
            optimizer,
            *(
                _fastest_cell(choice, key, index)
                for index in range(len(targets))
                for key in ("steps_to_target", "time_to_target")
            ),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _parallel_cells(setting: Setting) -> list[str]:
    """World size(s) and median communication ms per step of a setting's runs."""
    sizes = "/".join(str(n) for n in sorted({r.world_size for r in setting.runs}))
    seconds = sorted(
        r.communication_per_step
        for r in setting.runs
        if r.communication_per_step is not None
    )
    ms = 1e3 * seconds[len(seconds) // 2] if seconds else math.nan
    return [sizes, format_number(ms, 3)]


def problem_table(
    problem: str, tuned: dict[str, Tuned], settings: list[Setting]
) -> str:
    """Markdown section of one problem: one row per optimizer (its tuned setting).

    Args:
        problem: Problem name.
        tuned: Optimizer name → tuned setting on this problem.
        settings: All settings of the sweep (for the per-step-time ratio).

    Returns:
        Markdown text.
    """
    first = describing_run(r for t in tuned.values() for r in t.best.runs)
    config = first.config.get("problem", {})
    metric = first.metric or config.get("metric", "metric")
    direction = "lower" if first.maximize is False else "higher"
    targets = first.targets
    parallel = any(
        r.world_size > 1 for s in settings if s.problem == problem for r in s.runs
    )
    columns = [
        "optimizer",
        "tuned",
        "seeds ok",
        f"final test {metric}",
        f"best test {metric}",
        *([] if metric == "loss" else ["final test loss"]),
        "final train loss",
        *(
            column
            for target in targets
            for column in (f"steps to {target:g}", f"time to {target:g} [s]")
        ),
        "ms/step",
        *(["world size", "comm ms/step"] if parallel else []),
        "× sgd",
        "peak memory [MiB]",
    ]
    lines = [
        f"## {problem}",
        "",
        f"Test metric: {metric} ({direction} is better), targets "
        f"{', '.join(f'{t:g}' for t in targets) or 'none'} (easier first), "
        f"{config.get('steps')} steps of batch size "
        f"{config.get('batch_size')}, evaluated every {config.get('eval_every')} "
        "steps.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    memory_kinds = set()
    for optimizer, choice in tuned.items():
        best = choice.best
        seeds = len(best.runs)
        step_times = sorted(best.step_times())
        ms = 1e3 * step_times[len(step_times) // 2] if step_times else math.nan
        peak, kind = best.peak_memory()
        memory_kinds.add(kind)
        cells = [
            optimizer,
            _tuned_cell(choice),
            f"{len(best.ok_runs)}/{seeds}",
            format_pm(*best.final("test_metric")),
            format_pm(*best.best_metric()),
            *([] if metric == "loss" else [format_pm(*best.final("test_loss"))]),
            format_pm(*best.final("train_loss")),
            *(
                _target_cell(best, key, index, seeds)
                for index in range(len(targets))
                for key in ("steps_to_target", "time_to_target")
            ),
            format_number(ms, 3),
            *(_parallel_cells(best) if parallel else []),
            format_number(step_time_ratio(settings, problem, optimizer), 3),
            format_number(peak, 4),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if targets:
        lines += _fastest_table(tuned, targets)
    lines += ["Grids (values tried; every setting over the same seeds):", ""]
    for optimizer, choice in tuned.items():
        grid = "; ".join(
            f"{key} ∈ {{{_grid_values(choice, key)}}}" for key in choice.grid
        )
        lines.append(
            f"- {optimizer}: {grid or 'one setting'} ({len(choice.candidates)} "
            f"setting(s) × {len(choice.best.runs)} seed(s))"
        )
    lines.append("")
    diverged = _divergence_lines([s for s in settings if s.problem == problem])
    if diverged:
        lines += ["Diverged runs (per setting):", "", *diverged, ""]
    if parallel:
        lines += [
            "World size: processes of the data-parallel job (torchrun; each trains "
            "on its shard of the global batch). comm ms/step: median over the runs "
            "of the time per step in the optimizer's torch.distributed collectives "
            "(DampedNewton's count; — for optimizers without one).",
            "",
        ]
    if "cpu_job_peak_rss" in memory_kinds:
        lines.append(
            "Peak memory on CPU is the process's resident-set high-water mark during "
            "the job (VmHWM, reset at its start): it includes the interpreter, the "
            "libraries and what earlier jobs of the sweep left resident."
        )
        lines.append("")
    if "cpu_process_max_rss" in memory_kinds:
        lines.append(
            "Peak memory on CPU is the process's resident-set high-water mark "
            "(ru_maxrss): in a sequential multirun it includes every earlier job of "
            "the sweep, so it only bounds the job's own peak from above."
        )
        lines.append("")
    return "\n".join(lines)


def markdown_report(
    settings: list[Setting], tuned_pairs: dict[tuple[str, str], Tuned]
) -> str:
    """The whole Markdown report (one section per problem).

    Args:
        settings: All settings.
        tuned_pairs: ``(problem, optimizer) → Tuned``.

    Returns:
        Markdown text.
    """
    devices = sorted({r.device or "?" for s in settings for r in s.runs})
    parts = [
        "# Optimizer benchmark",
        "",
        f"{NOTES} Device(s): {', '.join(devices)}.",
        "",
    ]
    for problem, tuned in _by_problem(tuned_pairs).items():
        parts.append(problem_table(problem, tuned, settings))
        paragraph = trade_off(problem, tuned, settings)
        if paragraph:
            parts += [f"**Trade-off.** {paragraph}", ""]
    return "\n".join(parts)


def _by_problem(
    tuned_pairs: dict[tuple[str, str], Tuned],
) -> dict[str, dict[str, Tuned]]:
    """``problem → optimizer → Tuned``, problems and optimizers in sweep order."""
    grouped: dict[str, dict[str, Tuned]] = {}
    for (problem, optimizer), choice in tuned_pairs.items():
        grouped.setdefault(problem, {})[optimizer] = choice
    return grouped


def write_report(sweep_dir: Path) -> dict[str, Path]:
    """Write CSV, Markdown and plots of a sweep into ``<sweep_dir>/report``.

    Args:
        sweep_dir: The sweep directory (holding the jobs' ``result.json``).

    Returns:
        Name → path of every file written (``csv``, ``markdown``, plot names).
    """
    results = load_results(sweep_dir)
    out = Path(sweep_dir) / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    settings = group_settings(results)
    tuned_pairs = tune(settings)
    paths = {"csv": write_csv(results, out / "runs.csv")}
    markdown = markdown_report(settings, tuned_pairs)
    paths["markdown"] = out / "summary.md"
    paths["markdown"].write_text(markdown)
    for problem, tuned in _by_problem(tuned_pairs).items():
        paths[f"curves_{problem}"] = plot_curves(
            problem,
            tuned,
            out / f"curves_{re.sub(r'[^A-Za-z0-9_.=-]+', '_', problem)}.png",
        )
        numeric = {k for t in tuned.values() for k in t.grid if numeric_grid(t, k)}
        for key in sorted(numeric):  # lists or names varied: no axis to plot on
            name = f"sensitivity_{problem}_{key}"
            paths[name] = plot_sensitivity(problem, key, tuned, out / f"{name}.png")
    paths["step_cost"] = plot_step_cost(settings, out / "step_cost.png")
    paragraphs = [
        trade_off(problem, tuned, settings)
        for problem, tuned in _by_problem(tuned_pairs).items()
    ]
    if any(paragraphs):
        paths["trade_off"] = out / "trade_off.md"
        paths["trade_off"].write_text("\n\n".join(p for p in paragraphs if p) + "\n")
    return paths


def print_locations(paths: dict[str, Path]) -> None:
    """Print the Markdown report, where every file is, and the trade-off last."""
    print(paths["markdown"].read_text())
    print(f"Report folder: {paths['markdown'].parent.resolve()}")
    for name, path in paths.items():
        print(f"  {name}: {path.resolve()}")
    if "trade_off" in paths:
        print(
            f"\nTrade-off, from this sweep's results:\n{paths['trade_off'].read_text()}"
        )


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point.

    Exits with status 2 and a one-line message (no traceback) when the directory
    does not exist or holds no results.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "sweep_dir",
        nargs="?",
        type=Path,
        help="Hydra sweep directory (default: the newest under multirun/)",
    )
    args = parser.parse_args(argv)
    if args.sweep_dir is not None and not args.sweep_dir.is_dir():
        parser.error(
            f"{args.sweep_dir} is not a directory: pass a sweep directory "
            "(multirun/<date>/<time>, printed at the end of a multirun), or nothing "
            "for the newest one under multirun/."
        )
    try:
        paths = write_report(args.sweep_dir or latest_sweep())
    except FileNotFoundError as error:  # no results: say so, without a traceback
        parser.error(str(error))
    print_locations(paths)
