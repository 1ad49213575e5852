"""Optimizer benchmarks configured by Hydra: ``python -m benchmarks.run``."""
