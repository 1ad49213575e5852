"""The optimizer's step pipeline (private), module by module in call order.

:class:`~dampednewton.DampedNewton` keeps the ``torch.optim`` contract; a step runs:

0. :mod:`.pipeline`: the driver; it calls the modules below in this order.
1. :mod:`.options`: the param groups as validated, typed options (per group, and
   those shared by the single backward pass).
2. Groups with the Kronecker basis (the default) then take :mod:`.kronecker`'s step:
   a BackPACK refresh pass (:mod:`.kronecker_refresh`: averaged factors and their
   eigenpairs, layers of one shape batched) or a plain backward pass, the layers'
   directions (:mod:`.kronecker_group`: layers of one shape batched; the noise
   filter's moments in :mod:`.kronecker_moments`; packed, as by default on a CUDA
   device, all layers in one padded batch, :mod:`.kronecker_packed`, its math
   replayed as a CUDA graph there, :mod:`.cuda_graphs`), one host read
   (:mod:`.kronecker_checks`), the update; :mod:`.kronecker_state` is what they keep.
   Groups with the Gram basis go on:
3. :mod:`.amortized`: between curvature refreshes, the lean step along a frozen
   basis after a plain backward pass; it ends the step there.
4. :mod:`.step_pass`: otherwise the closure runs once in a BackPACK pass
   (:mod:`.closure`: under the one-backward check), with the diagnostics monitor's
   extensions; each group goes into it as a :mod:`.step_block` (typed options,
   averaged factor, frozen coefficients).
5. :mod:`.group_step`: each group's direction from its reduced GGN block (ViViT's
   step, the Newton fraction, the complement), :mod:`.averaged_step` along the
   averaged curvature; both give a :mod:`.group_result`.
6. :mod:`.quadratic_model`: the step's predicted change and trust-region scale.
7. :mod:`.step_status`: the step's device-side checks and counts, in one host read.
8. :mod:`.guard`: a refused step (non-finite) leaves no trace.
9. :mod:`.update`: the parameter update (trust region, momentum, weight decay).
10. :mod:`.records`: per-group statistics and ``newton/*`` diagnostics.
11. :mod:`.adaptation`: adaptive damping from the step's reduction ratio.

Beside the step, :mod:`.group_checks` checks a param group as it is added,
:mod:`.checkpoint` checks state dicts before loading, :mod:`.saved_records` puts the
records into their param groups and :mod:`.unpicklable` wraps settings that cannot be
pickled.

Nothing below this package (``math/``, ``policies/``, ``backpack/``,
``computations/``, ``diagnostics/``) imports from it (``tests/test_layering.py``).
"""
