"""The engine under every GGN computation: extensions, hook, per-group results.

During ``loss.backward()`` inside ``backpack(*extensions, extension_hook=hook)``,
BackPACK calls the hook on every module once that module's extensions ran. The hook
reduces the module's parameters' BackPACK buffers into the running Gram matrix (and
gradient products) of their block, frees the buffers, and finishes a block as soon as
all of its parameters were seen (or, for finishers that read ``.grad``, when its
result is asked for). The loss module is reached first: it starts a new backward pass.

With a :class:`~dampednewton.backpack.global_batch.GlobalBatch` (data parallelism), the
hook only keeps the buffers; :meth:`GGNEngine.reduce_kept`, called on every rank
after the backward pass, gathers them over the ranks and reduces them, so that no
collective runs inside a backward pass that may fail on one rank.

An engine that :attr:`~GGNEngine.accumulates` takes a closure's several backward
passes through the loss as micro-batches of one batch (gradient accumulation): it
keeps their buffers (:class:`~dampednewton.computations.passes.ClosurePasses`) and
:meth:`GGNEngine.reduce_kept` reduces those of the concatenated batch. The first
micro-batch is reduced during its backward pass as usual; a second one discards
that reduction.

:class:`~dampednewton.computations.interface.GGNComputation` is the ViViT interface
that each computation class exposes over its engine; the classes only say what they
need and how to finish a block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor
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
from dampednewton.backpack.loss_checks import check_reduction
from dampednewton.backpack.passes import Hook, chained
from dampednewton.backpack.savefields import (
    GRAD_BATCH,
    module_input,
    sqrt_ggn_savefield,
)
from dampednewton.backpack.unsupported import tied_parameter_message
from dampednewton.computations.block import Block
from dampednewton.computations.groups import (
    check_subsampling_in_range,
    group_key,
    validate_param_groups,
)
from dampednewton.computations.passes import ClosurePasses, KeptBuffers
from dampednewton.computations.settings import GGNSettings
from dampednewton.math.factors import LayerCache

ResultT = TypeVar("ResultT")


class GGNEngine(Generic[ResultT]):
    """Builds extensions and the hook, reduces blocks, and finishes them.

    What a block becomes is the ``finish`` function's (or callable object's) job:
    ViViT's computations pass their finisher, the optimizer its group step.

    Attributes:
        settings: The approximation.
        needs_gradients: Whether per-sample gradients are reduced.
        defers_finish: Finish blocks in :meth:`result` (after backward, when
            ``.grad`` is complete) rather than in the hook.
        accumulates: Take several backward passes through the loss after one
            :meth:`hook` as micro-batches of one batch (needs ``defers_finish``
            and :meth:`reduce_kept` after the passes); otherwise each pass starts
            afresh.
        global_batch: Gathers the buffers over the ranks (data parallelism).
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
        self.accumulates = False
        self._passes = ClosurePasses()
        self._sqrt_ggn: ExactSqrtGGN | MonteCarloSqrtGGN | None = None

    @property
    def batch_size(self) -> int | None:
        """The local batch size of the backward passes (``None``: none ran).

        With accumulation: the samples of every micro-batch.
        """
        return self._passes.batch_size or self._batch_size

    def reduce_kept(self) -> None:
        """Reduce the buffers kept during the backward passes (every rank).

        Under data parallelism they are first gathered over the ranks (the gathered
        gradient samples are all used: sub-sampling took them locally); with
        several micro-batches, concatenated. A single pass reduced during backward
        has nothing left to reduce.
        """
        streamed = self.global_batch is None and self._passes.count <= 1
        layers = self._passes.take()
        if streamed:
            return
        global_batch = self.global_batch
        for batch_size, layer in layers:
            cache = LayerCache()
            stored = [entry.stored for entry in layer]
            subsampling_grad = self.settings.subsampling_grad
            if global_batch is not None:
                stored = global_batch.layer(stored)
                batch_size *= global_batch.world_size
                subsampling_grad = None
            for entry, whole in zip(layer, stored, strict=True):
                self._reduce(
                    entry.index,
                    entry.param,
                    whole.sqrt_ggn,
                    whole.grad_batch,
                    batch_size,
                    cache,
                    subsampling_grad=subsampling_grad,
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
        self._sqrt_ggn = sqrt_ggn  # it records the loss weights of micro-batches
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
            frozen = any(
                group_key(known) == key
                and not any(p.requires_grad for p in known["params"])
                for known in self._groups
            )
            hint = (
                " None of its parameters requires a gradient (requires_grad=False), "
                "so it has no GGN block: leave it out of the groups."
                if frozen
                else f" {len(pending)} of its trainable parameters were not reached "
                "by the backward pass: are they used in the forward pass, and are "
                "model and loss extended with backpack.extend?"
                if pending
                else " Run the backward pass inside `with backpack(*ext, "
                "extension_hook=hook)` with the hook of this computation first."
            )
            raise KeyError(f"No result for this parameter group.{hint}")
        return self._results[key]

    def _reset(self) -> None:
        self._batch_size = None
        self._modules: dict[int, int] = {}  # the module that uses each parameter
        self._passes.clear()
        self._restart_blocks()

    def _restart_blocks(self) -> None:
        self._blocks = {}
        self._ready = {}
        self._results = {}
        for index, group in enumerate(self._groups):
            trainable = {id(p) for p in group["params"] if p.requires_grad}
            if trainable:
                self._blocks[index] = Block(group=group, pending=trainable)

    def _print(self, message: str) -> None:
        if self.settings.verbose:
            print(f"[dampednewton] {message}")

    def _start_pass(self, loss: _Loss) -> None:
        check_reduction(loss)
        if self.accumulates and self._passes.count > 0:
            self._next_micro_batch()
        else:
            self._reset()
        self._batch_size = batch_size = _input_batch_size(loss)
        for name, argument in self.settings.arguments():
            indices = getattr(self.settings, name)
            check_subsampling_in_range(indices, batch_size, argument)
        weight = None if self._sqrt_ggn is None else self._sqrt_ggn.loss_weight
        self._passes.start(batch_size, weight)
        self._print(f"backward pass started, batch size {batch_size}")

    def _next_micro_batch(self) -> None:
        """A further backward pass through the loss: keep, no longer stream.

        Raises:
            ValueError: With sub-sampling, whose indices select samples of one pass.
        """
        settings = self.settings
        if (
            settings.subsampling_ggn is not None
            or settings.subsampling_grad is not None
        ):
            ggn = settings.ggn_argument
            raise ValueError(
                "The closure back-propagated several micro-batches (gradient "
                f"accumulation), but {ggn} and subsampling_grad select samples of one "
                f"backward pass. Use {ggn}=None and subsampling_grad=None with "
                "gradient accumulation."
            )
        if self._passes.count == 1 and self.global_batch is None:
            self._restart_blocks()  # the first micro-batch was reduced: start over

    def _reduce_module(self, module: Module) -> None:
        if isinstance(module, _Loss):
            self._start_pass(module)
            return
        batch_size = self._batch_size or _input_batch_size(module)
        cache = LayerCache()  # lets the parameters of this layer share work
        streaming = self.global_batch is None and self._passes.count <= 1
        kept: list[KeptBuffers] = []
        for param in module.parameters(recurse=False):
            index = self._group_of_param.get(id(param))
            if index is None:
                continue
            if self._modules.setdefault(id(param), id(module)) != id(module):
                raise NotImplementedError(tied_parameter_message(param, module))
            block = self._blocks.get(index)
            if block is None or id(param) not in block.pending:
                continue
            sqrt_ggn = getattr(param, self.savefields[0])
            grad_batch = getattr(param, GRAD_BATCH, None)
            if not streaming or self.accumulates:
                kept.append(KeptBuffers(index, param, Stored(sqrt_ggn, grad_batch)))
            if streaming:
                self._reduce(
                    index,
                    param,
                    sqrt_ggn,
                    grad_batch,
                    batch_size,
                    cache,
                    subsampling_grad=self.settings.subsampling_grad,
                )
        if kept:
            self._passes.keep(kept, batch_size)

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


def _input_batch_size(module: Module) -> int:
    """The batch size of the input BackPACK stored on a module."""
    return module_input(module).shape[0]


def _add(total: Tensor | None, term: Tensor) -> Tensor:
    return term if total is None else total.add_(term)
