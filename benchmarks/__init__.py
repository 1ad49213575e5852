"""Optimizer benchmarks configured by Hydra: ``python -m benchmarks.run``.

The entry point :mod:`benchmarks.run` sits on top; below it:

* :mod:`benchmarks.sweep`: the Hydra sweep runner (one job, grids, resume,
  checkpoints, data parallelism, progress and the end-of-sweep callbacks);
* :mod:`benchmarks.problems`: the offline data sets, models and problem configs;
* :mod:`benchmarks.report`: the report of a sweep (``python -m benchmarks.report``);
* :mod:`benchmarks.micro`: micro-benchmarks of one step on one harness
  (``python -m benchmarks.micro.step_cost`` and its siblings);
* :mod:`benchmarks.scaling`: data-parallel scaling and its communication model;
* :mod:`benchmarks.measure`: device selection, synchronized timing and peak memory,
  shared by the sweep and the micro-benchmarks.
"""
