"""``python -m benchmarks.report [SWEEP_DIR]``: rebuild the report of a sweep."""

from benchmarks.report.report import main

main()
