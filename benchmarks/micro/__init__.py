"""Micro-benchmarks of one optimizer step (print tables, record nothing).

Each runs as a module, e.g. ``python -m benchmarks.micro.step_cost --threads 1``.
:mod:`~benchmarks.micro.harness` is their one harness: the models, the steps and
the round-robin timing.
"""
