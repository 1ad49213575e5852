"""examples/lightning_mlp.py trains, and its diagnostics reach TensorBoard."""

from __future__ import annotations

import runpy

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.markdown import ROOT

EXAMPLE = ROOT / "examples" / "lightning_mlp.py"


def test_lightning_example(tmp_path):
    example = runpy.run_path(str(EXAMPLE))  # as a module: main() is not run yet
    first, last = example["main"](str(tmp_path))
    assert last < first / 3, (first, last)  # the script's own check
    (run,) = (tmp_path / "lightning_mlp").iterdir()
    events = EventAccumulator(str(run), size_guidance={"histograms": 0})
    events.Reload()
    steps = example["EPOCHS"] * example["SAMPLES"] // example["BATCH_SIZE"]
    monitored = range(0, steps, 4)  # the example's EveryKSteps(4)
    assert [e.step for e in events.Scalars("gsnr/mean")] == list(monitored)
    assert [e.step for e in events.Histograms("grad_hist/counts")] == list(monitored)
    assert len(events.Scalars("train_loss")) == steps
