"""Lightning's import, with what to do when a broken torchvision stops it.

torchmetrics (imported by Lightning) imports torchvision whenever its metadata is
installed; PyPI's torchvision wheel next to a CPU torch then fails with "operator
torchvision::nms does not exist". ``make`` uninstalls such a torchvision (see the
Makefile); an environment set up by hand gets this message instead.
"""

from __future__ import annotations

try:
    import lightning  # noqa: F401
except RuntimeError as error:
    if "torchvision" not in str(error):
        raise
    raise ImportError(
        "Lightning cannot be imported because the installed torchvision does not "
        "fit this torch build. Run `pip uninstall torchvision` (nothing here needs "
        "it; `make test` does this in .venv)."
    ) from error
