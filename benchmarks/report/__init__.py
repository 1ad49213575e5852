"""The report of a sweep (``python -m benchmarks.report [SWEEP_DIR]``).

* :mod:`~benchmarks.report.aggregate`: results grouped into settings and tuned;
* :mod:`~benchmarks.report.report`: writes ``runs.csv``
  (:mod:`~benchmarks.report.runs_csv`), ``summary.md``, the plots
  (:mod:`~benchmarks.report.plots`) and ``trade_off.md``
  (:mod:`~benchmarks.report.trade_off`), formatted by :mod:`~benchmarks.report.text`.
"""
