"""The LAYERS registry and the private BackPACK API it relies on."""

from __future__ import annotations

import pytest
from backpack.extensions import BatchGrad, SqrtGGNExact
from backpack.extensions.module_extension import ModuleExtension
from torch import nn

from dampednewton.backpack.layers import (
    LAYERS,
    use_structured_individual_gradients,
    use_structured_sqrt_ggn,
)
from dampednewton.backpack.private import (
    default_param_function,
    registered_module_types,
)
from dampednewton.backpack.savefields import (
    SQRT_GGN_EXACT,
    SQRT_GGN_MC,
    sqrt_ggn_savefield,
)


@pytest.mark.parametrize("module_class", list(LAYERS), ids=lambda c: c.__name__)
def test_every_layer_makes_both_module_extensions(module_class):
    layer = LAYERS[module_class]
    assert isinstance(layer.sqrt_ggn(), ModuleExtension)
    assert isinstance(layer.individual_gradients(), ModuleExtension)


def test_structured_extensions_are_registered_for_every_layer():
    sqrt_ggn, gradients = SqrtGGNExact(), BatchGrad()
    use_structured_sqrt_ggn(sqrt_ggn)
    use_structured_individual_gradients(gradients)
    for extension in (sqrt_ggn, gradients):
        assert set(LAYERS) <= set(registered_module_types(extension))


def test_private_api_is_still_there():
    """Guards the two private BackPACK names this package uses."""
    assert nn.Linear in registered_module_types(SqrtGGNExact())
    module_extension = LAYERS[nn.Linear].sqrt_ggn()
    assert callable(default_param_function(module_extension, "weight"))


def test_sqrt_ggn_savefield_follows_the_extension():
    assert sqrt_ggn_savefield(0) == SQRT_GGN_EXACT == SqrtGGNExact().savefield
    assert sqrt_ggn_savefield(3) == SQRT_GGN_MC
