"""Optimizer benchmarks configured by Hydra (entry point: ``benchmarks/run.py``)."""
