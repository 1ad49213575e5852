"""Hook plumbing shared by the GGN computations.

During ``loss.backward()`` inside ``backpack(*extensions, extension_hook=hook)``,
BackPACK calls the hook on every module once that module's extensions ran. The hook
reduces the module's parameters' BackPACK buffers into the running Gram matrix (and
gradient products) of their block, frees the buffers, and finishes a block as soon as
all of its parameters were seen. The loss module is reached first: it starts a new
backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from backpack.extensions.backprop_extension import BackpropExtension
from torch import Generator, Tensor
from torch.nn import Conv1d, Conv2d, Conv3d, Linear, Module
from torch.nn.modules.loss import _Loss

from dampednewton.computations.assembly import Factor, make_factor
from dampednewton.computations.extensions import (
    ExactSqrtGGN,
    IndividualGradients,
    MonteCarloSqrtGGN,
)
from dampednewton.computations.groups import check_subsampling_in_range, group_key
from dampednewton.computations.structured import (
    STRUCTURED_BATCH_GRAD,
    StructuredSqrtGGNConv,
    StructuredSqrtGGNLinear,
)
from dampednewton.factors import DenseFactor
from dampednewton.options import (
    check_integer,
    check_subsampling,
    check_warn_small_eigvals,
    validate_param_groups,
)

GRAD_BATCH = "grad_batch"


@dataclass
class Block:
    """Running reductions of one GGN block during a backward pass.

    Attributes:
        group: The parameter group that defines the block.
        pending: ``id``s of trainable parameters not reached yet.
        gram: Running Gram matrix ``VᵀV`` (``[C·N, C·N]``).
        gradient_products: Running ``[N', C·N]`` products of per-sample gradients with
            ``V``, when gradients are needed.
        factors: Square-root factors by parameter ``id``, kept only when eigenvectors
            or steps are mapped back to parameter space.
        num_outputs: ``C``, square-root columns per sample (classes or MC samples).
        num_samples: ``N``, the samples that built the Gram matrix.
    """

    group: dict
    pending: set[int]
    gram: Tensor | None = None
    gradient_products: Tensor | None = None
    factors: dict[int, Factor] = field(default_factory=dict)
    num_outputs: int = 0
    num_samples: int = 0


class GGNComputation:
    """Base class: extensions, hook, and per-group results of one computation.

    Subclasses set which quantities the hook keeps and implement :meth:`_finish`.
    """

    required_group_keys: tuple[str, ...] = ()
    keeps_factors: bool = False
    needs_gradients: bool = False
    # Finish blocks in get_result (after backward, when `.grad` is complete) rather
    # than in the hook.
    defers_finish: bool = False

    def __init__(
        self,
        *,
        subsampling_ggn: Sequence[int] | None = None,
        subsampling_grad: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
        generator: Generator | None = None,
        structured: bool = True,
    ):
        """Store and validate the approximation settings.

        Args:
            subsampling_ggn: Samples for the GGN (directions, curvatures), ``None``:
                all.
            subsampling_grad: Samples for the gradients; ``None``: all.
            mc_samples: ``0`` for the exact GGN, else the number of Monte-Carlo samples
                of the loss Hessian's square root.
            verbose: Print what happens during backpropagation.
            warn_small_eigvals: Warn when a selected eigenvalue's magnitude is below.
            generator: Random source for Monte-Carlo sampling (``None``: global).
            structured: Exploit ``nn.Linear``'s Kronecker structure instead of
                materializing its square root and individual gradients.

        Raises:
            TypeError: For a non-integer ``mc_samples`` or a non-number
                ``warn_small_eigvals``.
            ValueError: For negative ``mc_samples`` or ``warn_small_eigvals``.
        """
        self._subsampling_ggn = check_subsampling(subsampling_ggn, "subsampling_ggn")
        self._subsampling_grad = check_subsampling(subsampling_grad, "subsampling_grad")
        self._mc_samples = check_integer("mc_samples", mc_samples, 0)
        self._verbose = verbose
        self._warn_small_eigvals = check_warn_small_eigvals(warn_small_eigvals)
        self._generator = generator
        self._structured = structured
        self._groups: list[dict] = []
        self._group_of_param: dict[int, int] = {}
        self._blocks: dict[int, Block] = {}
        self._ready: dict[tuple[int, ...], Block] = {}
        self._results: dict[tuple[int, ...], Any] = {}
        self._batch_size: int | None = None

    @property
    def sqrt_ggn_savefield(self) -> str:
        """Attribute under which BackPACK stores the GGN square root."""
        return "sqrt_ggn_mc" if self._mc_samples > 0 else "sqrt_ggn_exact"

    def get_extensions(self) -> list[BackpropExtension]:
        """Instantiate the BackPACK extensions this computation needs.

        Returns:
            Extensions to pass to the ``with backpack(...)`` context.
        """
        if self._mc_samples > 0:
            sqrt_ggn = MonteCarloSqrtGGN(
                self._mc_samples, self._subsampling_ggn, self._generator
            )
        else:
            sqrt_ggn = ExactSqrtGGN(subsampling=self._subsampling_ggn)
        extensions: list[BackpropExtension] = [sqrt_ggn]
        if self._structured:
            sqrt_ggn.set_module_extension(
                Linear, StructuredSqrtGGNLinear(), overwrite=True
            )
            for conv in (Conv1d, Conv2d, Conv3d):
                sqrt_ggn.set_module_extension(
                    conv, StructuredSqrtGGNConv(conv), overwrite=True
                )
        if self.needs_gradients:
            # After the square roots: their buffers tell which gradients to skip.
            gradients = IndividualGradients(subsampling=self._subsampling_grad)
            if self._structured:
                for module_class, module_extension in STRUCTURED_BATCH_GRAD.items():
                    gradients.set_module_extension(
                        module_class, module_extension(), overwrite=True
                    )
            extensions.append(gradients)
        return extensions

    def get_extension(self) -> BackpropExtension:
        """Instantiate the single BackPACK extension of gradient-free computations.

        Returns:
            The square-root extension to pass to the ``with backpack(...)`` context.
        """
        return self.get_extensions()[0]

    def get_extension_hook(self, param_groups: Sequence[dict]) -> Callable[[Module]]:
        """Instantiate the hook that reduces BackPACK's buffers during backward.

        Args:
            param_groups: Groups as for a ``torch.optim.Optimizer``; each group is one
                GGN block. See the subclass for the keys it needs.

        Returns:
            The hook to pass as ``extension_hook`` to ``backpack(...)``. It computes
            every group's result during the backward pass (fresh ones on every pass).
        """
        self._groups = validate_param_groups(param_groups, self.required_group_keys)
        self._group_of_param = {
            id(p): index
            for index, group in enumerate(self._groups)
            for p in group["params"]
        }
        self._reset()
        return self._hook

    def get_result(self, group: dict) -> Any:
        """Return the result of a group after the backward pass.

        Args:
            group: Parameter group that defines the GGN block.

        Returns:
            The subclass's result for the group.

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
        for index, group in enumerate(self._groups):
            trainable = {id(p) for p in group["params"] if p.requires_grad}
            if trainable:
                self._blocks[index] = Block(group=group, pending=trainable)

    def _print(self, message: str) -> None:
        if self._verbose:
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
        self._batch_size = loss.input0.shape[0]
        check_subsampling_in_range(
            self._subsampling_ggn, self._batch_size, "subsampling_ggn"
        )
        check_subsampling_in_range(
            self._subsampling_grad, self._batch_size, "subsampling_grad"
        )
        self._print(f"backward pass started, batch size {self._batch_size}")

    def _hook(self, module: Module) -> None:
        if isinstance(module, _Loss):
            self._start_pass(module)
            return
        shared: dict = {}  # lets the parameters of this layer share work
        for param in module.parameters(recurse=False):
            index = self._group_of_param.get(id(param))
            block = self._blocks.get(index) if index is not None else None
            if block is not None and id(param) in block.pending:
                self._reduce(block, param, module, shared)
                if not block.pending:
                    self._print(f"group {index}: all parameters reduced")
                    if self.defers_finish:
                        self._ready[group_key(block.group)] = block
                    else:
                        self._results[group_key(block.group)] = self._finish(block)
                    del self._blocks[index]
            self._free(param)

    def _reduce(
        self, block: Block, param: Tensor, module: Module, shared: dict
    ) -> None:
        sqrt_ggn = getattr(param, self.sqrt_ggn_savefield)
        factor = make_factor(
            sqrt_ggn,
            getattr(param, GRAD_BATCH, None),
            batch_size=self._batch_size or module.input0.shape[0],
            subsampling_grad=self._subsampling_grad,
            with_gradients=self.needs_gradients,
            shared=shared,
        )
        if isinstance(factor, DenseFactor):
            block.num_outputs, block.num_samples = sqrt_ggn.shape[:2]
        else:
            block.num_outputs, block.num_samples = factor.backproped.shape[:2]
        block.gram = _add(block.gram, factor.gram(shared))
        if self.needs_gradients:
            block.gradient_products = _add(
                block.gradient_products, factor.gradient_products(shared)
            )
            factor.drop_gradients()
        if self.keeps_factors:
            block.factors[id(param)] = factor
        block.pending.discard(id(param))

    def _free(self, param: Tensor) -> None:
        for savefield in (self.sqrt_ggn_savefield, GRAD_BATCH):
            if savefield != GRAD_BATCH or self.needs_gradients:
                if hasattr(param, savefield):
                    delattr(param, savefield)

    def _finish(self, block: Block) -> Any:
        raise NotImplementedError


def _add(total: Tensor | None, term: Tensor) -> Tensor:
    return term if total is None else total.add_(term)
