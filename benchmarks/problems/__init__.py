"""The benchmark problems: offline data, models, peers and their Hydra targets.

* :mod:`~benchmarks.problems.data` (with :mod:`~benchmarks.problems.quadratics`):
  data sets as tensors;
* :mod:`~benchmarks.problems.models`: seeded models;
* :mod:`~benchmarks.problems.problems`: a composed problem (data, model, loss,
  metric, targets);
* :mod:`~benchmarks.problems.peers`: optimizers that need more than a ``_target_``.
"""
