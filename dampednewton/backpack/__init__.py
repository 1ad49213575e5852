"""All coupling to BackPACK: extensions, supported layers, one backward pass.

* :mod:`~dampednewton.backpack.savefields`: the attribute names BackPACK writes.
* :mod:`~dampednewton.backpack.private`: the only uses of BackPACK's private API.
* :mod:`~dampednewton.backpack.extensions`: extensions with actionable errors and
  Monte-Carlo sampling from a ``torch.Generator``.
* :mod:`~dampednewton.backpack.seeding`: the seeded generator of the optimizer's and
  the monitor's Monte-Carlo sampling, and the global stream forked onto it.
* :mod:`~dampednewton.backpack.layers`: the :data:`~dampednewton.backpack.layers.LAYERS`
  registry, module type → structured module extensions.
* :mod:`~dampednewton.backpack.buffers`: what the structured extensions store, and
  how BackPACK's buffers become a :class:`~dampednewton.math.factors.Factor`.
* :mod:`~dampednewton.backpack.passes`: one backward pass for several consumers
  (merge extensions, chain hooks, free buffers as soon as they are reduced).
"""
