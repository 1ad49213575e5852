"""Pure tensor math of the damped Newton step: no hooks, no optimizer state.

* :mod:`~dampednewton.math.linalg`: symmetric eigensolvers (float64 retry, Krylov).
* :mod:`~dampednewton.math.gram_space`: directional derivatives ``γ``, ``λ`` and Newton
  coefficients from Gram-space eigenpairs.
* :mod:`~dampednewton.math.factors`: the :class:`~dampednewton.math.factors.Factor`
  protocol, the typed per-layer cache and the materialized factor;
  :mod:`~dampednewton.math.linear_factors`: the Kronecker-structured ones.
* :mod:`~dampednewton.math.cost`: multiply-add models that pick a route.
* :mod:`~dampednewton.math.sampling`: Monte-Carlo square roots of the loss Hessian.
* :mod:`~dampednewton.math.finite`: the step's cheap finiteness check.
"""
