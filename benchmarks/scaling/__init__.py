"""Data-parallel scaling: ``python -m benchmarks.scaling.scaling``.

:mod:`~benchmarks.scaling.scaling` measures on CPU/gloo with
:mod:`~benchmarks.scaling.scaling_worker` and extrapolates with
:mod:`~benchmarks.scaling.communication_model`.
"""
