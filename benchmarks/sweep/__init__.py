"""The Hydra sweep runner below :mod:`benchmarks.run`, in the order a job meets it.

* :mod:`~benchmarks.sweep.sweep_plan`, :mod:`~benchmarks.sweep.eta`: the jobs of a
  multirun, their kinds and the time they should take;
* :mod:`~benchmarks.sweep.grid`, :mod:`~benchmarks.sweep.config_dict`: a job's grid
  point and plain-data config;
* :mod:`~benchmarks.sweep.job`: one job, from config to ``result.json``;
  :mod:`~benchmarks.sweep.resume` keeps a finished one;
* :mod:`~benchmarks.sweep.training`: the training loop, with
  :mod:`~benchmarks.sweep.checkpointing` and :mod:`~benchmarks.sweep.data_parallel`;
* :mod:`~benchmarks.sweep.result`, :mod:`~benchmarks.sweep.atomic`: the record and
  its atomic write;
* :mod:`~benchmarks.sweep.callbacks`: progress and the end of a multirun, which runs
  :mod:`~benchmarks.sweep.grid_extension` and writes the report.
"""
