"""The engine under every GGN computation: extensions, hook, per-group results.

During ``loss.backward()`` inside ``backpack(*extensions, extension_hook=hook)``,
BackPACK calls the hook on every module once that module's extensions ran. The hook
reduces the module's parameters' BackPACK buffers into the running Gram matrix (and
gradient products) of their block, frees the buffers, and finishes a block as soon as
all of its parameters were seen (or, for finishers that read ``.grad``, when its
result is asked for). The loss module is reached first: it starts a new backward pass.

With a :class:`~dampednewton.backpack.global_batch.GlobalBatch` (data parallelism), the
hook only keeps the buffers; :meth:`GGNEngine.reduce_global_batch`, called on every
rank after the backward pass, gathers them over the ranks and reduces them, so that
no collective runs inside a backward pass that may fail on one rank.

:class:`~dampednewton.computations.interface.GGNComputation` is the ViViT interface
that each computation class exposes over its engine; the classes only say what they
need and how to finish a block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from backpack.extensions.backprop_extension import BackpropExtension
from torch import Generator, Tensor
from torch.nn import Module
from torch.nn.modules.loss import _Loss

from dampednewton.backpack.buffers import (
    Assembly,
    Buffers,
    factor_size,
    make_factor,
)
from dampednewton.backpack.extensions import (
    ExactSqrtGGN,
    IndividualGradients,
    MonteCarloSqrtGGN,
)
from dampednewton.backpack.global_batch import GlobalBatch, Stored
from dampednewton.backpack.layers import (
    use_structured_individual_gradients,
    use_structured_sqrt_ggn,
)
from dampednewton.backpack.passes import Hook, chained
from dampednewton.backpack.savefields import (
    GRAD_BATCH,
    module_input,
    sqrt_ggn_savefield,
)
from dampednewton.checks import (
    check_integer,
    check_subsampling,
    check_warn_small_eigvals,
)
from dampednewton.computations.block import Block
from dampednewton.computations.groups import (
    check_subsampling_in_range,
    group_key,
    validate_param_groups,
)
from dampednewton.math.factors import LayerCache

ResultT = TypeVar("ResultT")


@dataclass(frozen=True)
class GGNSettings:
    """The GGN and gradient approximation of a computation, validated.

    ViViT's keywords map onto these once: ``subsampling`` (eigenvalue and eigenpair
    computations) is ``subsampling_ggn``, ``mc_samples_ggn`` (directional
    derivatives, damped Newton) is ``mc_samples``.

    Attributes:
        subsampling_ggn: Samples for the GGN (directions, curvatures), ``None``: all.
        subsampling_grad: Samples for the gradients; ``None``: all.
        mc_samples: ``0`` for the exact GGN, else the number of Monte-Carlo samples
            of the loss Hessian's square root.
        verbose: Print what happens during backpropagation.
        warn_small_eigvals: Warn when a selected eigenvalue's magnitude is below.
        generator: Random source for Monte-Carlo sampling (``None``: global).
        structured: Exploit the Kronecker structure of the layers in
            :data:`~dampednewton.backpack.layers.LAYERS` instead of materializing
            their square roots and individual gradients.
    """

    subsampling_ggn: Sequence[int] | None = None
    subsampling_grad: Sequence[int] | None = None
    mc_samples: int = 0
    verbose: bool = False
    warn_small_eigvals: float = 1e-4
    generator: Generator | None = None
    structured: bool = True

    def __post_init__(self) -> None:
        """Validate the settings and store sub-sampling indices as lists.

        Raises:
            TypeError: For a non-integer ``mc_samples``, a non-number
                ``warn_small_eigvals`` or non-integer sub-sampling indices.
            ValueError: For negative ``mc_samples`` or ``warn_small_eigvals``, or
                empty, negative or repeated sub-sampling indices.
        """
        for name in ("subsampling_ggn", "subsampling_grad"):
            object.__setattr__(self, name, check_subsampling(getattr(self, name), name))
        object.__setattr__(
            self, "mc_samples", check_integer("mc_samples", self.mc_samples, 0)
        )
        object.__setattr__(
            self,
            "warn_small_eigvals",
            check_warn_small_eigvals(self.warn_small_eigvals),
        )


class GGNEngine(Generic[ResultT]):
    """Builds extensions and the hook, reduces blocks, and finishes them.

    What a block becomes is the ``finish`` function's (or callable object's) job:
    ViViT's computations pass their finisher, the optimizer its group step.

    Attributes:
        settings: The approximation.
        needs_gradients: Whether per-sample gradients are reduced.
        defers_finish: Finish blocks in :meth:`result` (after backward, when
            ``.grad`` is complete) rather than in the hook.
    """

    def __init__(
        self,
        settings: GGNSettings,
        finish: Callable[[Block], ResultT],
        *,
        required_group_keys: tuple[str, ...] = (),
        keeps_factors: bool = False,
        needs_gradients: bool = False,
        defers_finish: bool = False,
    ):
        """Configure the engine.

        Args:
            settings: The approximation.
            finish: Turns a block whose parameters were all reduced into a result.
            required_group_keys: Keys every parameter group needs besides
                ``'params'``.
            keeps_factors: Keep the factors to map Gram-space vectors back.
            needs_gradients: Reduce per-sample gradients.
            defers_finish: See the attribute.
        """
        self.settings = settings
        self.needs_gradients = needs_gradients
        self.defers_finish = defers_finish
        self._finish = finish
        self._required_group_keys = required_group_keys
        self._keeps_factors = keeps_factors
        self._groups: list[dict] = []
        self._group_of_param: dict[int, int] = {}
        self._blocks: dict[int, Block] = {}
        self._ready: dict[tuple[int, ...], Block] = {}
        self._results: dict[tuple[int, ...], ResultT] = {}
        self._batch_size: int | None = None
        self.global_batch: GlobalBatch | None = None
        self._kept: list[tuple[int, list[_KeptBuffers]]] = []

    @property
    def batch_size(self) -> int | None:
        """The local batch size of the last backward pass (``None``: none ran)."""
        return self._batch_size

    def reduce_global_batch(self) -> None:
        """Gather the kept buffers over the ranks and reduce them (every rank).

        The gathered gradient samples are all used: sub-sampling took them locally.

        Raises:
            RuntimeError: Without a :attr:`global_batch`.
        """
        global_batch = self.global_batch
        if global_batch is None:
            raise RuntimeError("reduce_global_batch needs a global_batch.")
        kept, self._kept = self._kept, []
        for batch_size, layer in kept:
            cache = LayerCache()
            stored = [Stored(entry.sqrt_ggn, entry.grad_batch) for entry in layer]
            for entry, gathered in zip(layer, global_batch.layer(stored), strict=True):
                self._reduce(
                    entry.index,
                    entry.param,
                    gathered.sqrt_ggn,
                    gathered.grad_batch,
                    batch_size * global_batch.world_size,
                    cache,
                    subsampling_grad=None,
                )

    @property
    def savefields(self) -> tuple[str, ...]:
        """The BackPACK quantities the hook reduces and frees."""
        sqrt_ggn = sqrt_ggn_savefield(self.settings.mc_samples)
        return (sqrt_ggn, GRAD_BATCH) if self.needs_gradients else (sqrt_ggn,)

    def extensions(self) -> list[BackpropExtension]:
        """Instantiate the BackPACK extensions: square root, then gradients.

        Returns:
            Extensions to pass to the ``with backpack(...)`` context.
        """
        settings = self.settings
        if settings.mc_samples > 0:
            sqrt_ggn = MonteCarloSqrtGGN(
                settings.mc_samples, settings.subsampling_ggn, settings.generator
            )
        else:
            sqrt_ggn = ExactSqrtGGN(subsampling=settings.subsampling_ggn)
        if settings.structured:
            use_structured_sqrt_ggn(sqrt_ggn)
        extensions: list[BackpropExtension] = [sqrt_ggn]
        if self.needs_gradients:
            # After the square roots: their buffers tell which gradients to skip.
            gradients = IndividualGradients(subsampling=settings.subsampling_grad)
            if settings.structured:
                use_structured_individual_gradients(gradients)
            extensions.append(gradients)
        return extensions

    def hook(self, param_groups: Sequence[dict]) -> Hook:
        """Instantiate the hook that reduces and frees BackPACK's buffers.

        Args:
            param_groups: Groups as for a ``torch.optim.Optimizer``; each group is one
                GGN block.

        Returns:
            The hook to pass as ``extension_hook`` to ``backpack(...)``. It computes
            every group's result during the backward pass (fresh ones on every pass).
        """
        self._groups = validate_param_groups(param_groups, self._required_group_keys)
        self._group_of_param = {
            id(p): index
            for index, group in enumerate(self._groups)
            for p in group["params"]
        }
        self._reset()
        return chained([self._reduce_module], self.savefields)

    def result(self, group: dict) -> ResultT:
        """Return the result of a group after the backward pass.

        Args:
            group: Parameter group that defines the GGN block.

        Returns:
            What ``finish`` made of the group's block.

        Raises:
            KeyError: If there is no result for the group.
        """
        key = group_key(group)
        if key in self._ready:
            self._results[key] = self._finish(self._ready.pop(key))
        if key not in self._results:
            pending = next(
                (b.pending for b in self._blocks.values() if group_key(b.group) == key),
                None,
            )
            hint = (
                f" {len(pending)} of its trainable parameters were not reached by the "
                "backward pass: are they used in the forward pass, and are model and "
                "loss extended with backpack.extend?"
                if pending
                else " Run the backward pass inside `with backpack(*ext, "
                "extension_hook=hook)` with the hook of this computation first."
            )
            raise KeyError(f"No result for this parameter group.{hint}")
        return self._results[key]

    def _reset(self) -> None:
        self._blocks = {}
        self._ready = {}
        self._results = {}
        self._batch_size = None
        self._kept = []
        for index, group in enumerate(self._groups):
            trainable = {id(p) for p in group["params"] if p.requires_grad}
            if trainable:
                self._blocks[index] = Block(group=group, pending=trainable)

    def _print(self, message: str) -> None:
        if self.settings.verbose:
            print(f"[dampednewton] {message}")

    def _start_pass(self, loss: _Loss) -> None:
        reduction = getattr(loss, "reduction", "mean")
        if reduction != "mean":
            raise ValueError(
                f"{loss} uses reduction='{reduction}', but the GGN computations assume "
                "reduction='mean' (the step would be off by the batch size). Use "
                f"{type(loss).__name__}(reduction='mean')."
            )
        self._reset()
        self._batch_size = batch_size = _input_batch_size(loss)
        for name in ("subsampling_ggn", "subsampling_grad"):
            indices = getattr(self.settings, name)
            check_subsampling_in_range(indices, batch_size, name)
        self._print(f"backward pass started, batch size {batch_size}")

    def _reduce_module(self, module: Module) -> None:
        if isinstance(module, _Loss):
            self._start_pass(module)
            return
        batch_size = self._batch_size or _input_batch_size(module)
        cache = LayerCache()  # lets the parameters of this layer share work
        kept: list[_KeptBuffers] = []
        for param in module.parameters(recurse=False):
            index = self._group_of_param.get(id(param))
            if index is None:
                continue
            block = self._blocks.get(index)
            if block is None or id(param) not in block.pending:
                continue
            sqrt_ggn = getattr(param, self.savefields[0])
            grad_batch = getattr(param, GRAD_BATCH, None)
            if self.global_batch is None:
                self._reduce(
                    index,
                    param,
                    sqrt_ggn,
                    grad_batch,
                    batch_size,
                    cache,
                    subsampling_grad=self.settings.subsampling_grad,
                )
            else:
                kept.append(_KeptBuffers(index, param, sqrt_ggn, grad_batch))
        if kept:
            self._kept.append((batch_size, kept))

    def _reduce(
        self,
        index: int,
        param: Tensor,
        sqrt_ggn: Tensor | Buffers,
        grad_batch: Tensor | None,
        batch_size: int,
        cache: LayerCache,
        *,
        subsampling_grad: Sequence[int] | None,
    ) -> None:
        block = self._blocks[index]
        assembly = Assembly(
            batch_size=batch_size,
            subsampling_grad=subsampling_grad,
            with_gradients=self.needs_gradients,
        )
        factor = make_factor(sqrt_ggn, grad_batch, assembly, cache)
        block.num_outputs, block.num_samples = factor_size(sqrt_ggn)
        block.gram = _add(block.gram, factor.gram(cache))
        if self.needs_gradients:
            block.gradient_products = _add(
                block.gradient_products, factor.gradient_products(cache)
            )
            factor.drop_gradients()
        if self._keeps_factors:
            block.factors[id(param)] = factor
        block.pending.discard(id(param))
        if not block.pending:
            self._print(f"group {index}: all parameters reduced")
            if self.defers_finish:
                self._ready[group_key(block.group)] = block
            else:
                self._results[group_key(block.group)] = self._finish(block)
            del self._blocks[index]


@dataclass(frozen=True)
class _KeptBuffers:
    """A parameter's BackPACK buffers, kept until the ranks gather them."""

    index: int
    param: Tensor
    sqrt_ggn: Tensor | Buffers
    grad_batch: Tensor | None


def _input_batch_size(module: Module) -> int:
    """The batch size of the input BackPACK stored on a module."""
    return module_input(module).shape[0]


def _add(total: Tensor | None, term: Tensor) -> Tensor:
    return term if total is None else total.add_(term)
