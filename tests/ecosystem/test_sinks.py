"""Diagnostics records written to TensorBoard and Lightning loggers, read back.

What a sink wrote is read back with TensorBoard's own event reader and compared
with the monitor's records: scalars as float32 (TensorBoard's ``simple_value``),
1D histograms bucket by bucket, 2D histograms pixel by pixel.
"""

from __future__ import annotations

import csv
import io

import lightning.pytorch as pl
import numpy as np
import pytest
from backpack import extend
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from dampednewton import DampedNewton
from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsLog,
    DiagnosticsMonitor,
    GradientHistogram,
    GradientParameterHistogram,
    LightningLoggerSink,
    NoiseScale,
    TensorBoardSink,
)
from dampednewton.diagnostics.sinks import (
    histogram_image,
    raw_histogram,
    split_record,
)
from tests.ecosystem.lightning_setup import (
    TRAINER_SETTINGS,
    Classifier,
    make_batches,
    make_loader,
    make_model,
)

PARTS_2D = ("/x_edges", "/y_edges", "/margins")

STEPS = 2


def specs():
    return [
        GSNR(),
        NoiseScale(),
        GradientHistogram(bins=8),
        GradientParameterHistogram(bins=(6, 5)),
        CurvatureTrace(),
    ]


def train_with_sinks(*sinks) -> DiagnosticsLog:
    """Two monitored DampedNewton steps; the log writes every record to ``sinks``."""
    model = make_model()
    loss_fn = extend(nn.CrossEntropyLoss())
    log = DiagnosticsLog(sinks=sinks)
    monitor = DiagnosticsMonitor(specs(), model.named_parameters(), log=log)
    optimizer = DampedNewton(model.parameters(), seed=0, monitor=monitor)
    for inputs, targets in make_batches()[:STEPS]:

        def closure(inputs=inputs, targets=targets):
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            return loss

        optimizer.step(closure)
    log.flush()
    assert len(log) == STEPS
    return log


def read_events(directory) -> EventAccumulator:
    events = EventAccumulator(
        str(directory), size_guidance={"scalars": 0, "histograms": 0, "images": 0}
    )
    events.Reload()
    return events


def by_step(events) -> dict[int, object]:
    steps = [event.step for event in events]
    assert len(set(steps)) == len(steps), f"a step was written twice: {steps}"
    return {event.step: event for event in events}


def assert_written(events: EventAccumulator, log: DiagnosticsLog) -> None:
    """Every record's entries are in the events, equal to the record's values."""
    splits = [split_record(record) for record in log]
    tags = events.Tags()
    assert set(tags["scalars"]) == set(splits[0].scalars)
    assert set(tags["histograms"]) == set(splits[0].histograms) | set(splits[0].arrays)
    assert set(tags["images"]) == set(splits[0].histograms_2d)
    for key in splits[0].scalars:
        written = by_step(events.Scalars(key))
        for split in splits:
            expected = float(np.float32(split.scalars[key]))
            assert written[split.step].value == expected, (key, split.step)
    for key in splits[0].histograms:
        written = by_step(events.Histograms(key))
        for split in splits:
            edges, counts = split.histograms[key]
            value = written[split.step].histogram_value
            assert list(value.bucket_limit) == edges.astype(np.float64).tolist()
            assert list(value.bucket) == [0, *counts.tolist()], key
            assert value.num == counts.sum()
    for key in splits[0].arrays:
        written = by_step(events.Histograms(key))
        for split in splits:
            values = split.arrays[key][np.isfinite(split.arrays[key])]
            value = written[split.step].histogram_value
            assert value.num == values.size, key
            assert (value.min, value.max) == (values.min(), values.max()), key
    for key in splits[0].histograms_2d:
        written = by_step(events.Images(key))
        for split in splits:
            image = written[split.step].encoded_image_string
            pixels = np.asarray(Image.open(io.BytesIO(image)))
            expected = histogram_image(split.histograms_2d[key])
            assert pixels.shape == (*expected.shape, 3)
            for channel in range(3):
                assert np.array_equal(pixels[..., channel], expected), key


def test_split_record_accounts_for_every_entry():
    record = train_with_sinks()[0]
    split = split_record(record)
    assert split.step == record["step"]
    written = set(split.scalars) | set(split.arrays)
    for key in split.histograms:
        written |= {key, key.replace("/counts", "/edges")}
    for key in split.histograms_2d:
        written |= {key, *(key.replace("/counts", part) for part in PARTS_2D)}
    outside = {key for key in split.scalars if "/out_of_range" in key}
    assert written - outside == set(record) - {"step"}
    assert set(split.histograms) == {
        key for key in record if key.startswith("grad_hist/counts")
    }
    assert set(split.histograms_2d) == {
        key for key in record if key.startswith("grad_param_hist/counts")
    }
    assert "newton/layer_curvatures/group0" in split.arrays  # the Kronecker basis
    for key in split.histograms_2d:
        margins = record[key.replace("/counts", "/margins")]
        expected = sum(
            int(margins[row, column])
            for row in range(3)
            for column in range(3)
            if (row, column) != (1, 1)
        )
        assert split.scalars[key.replace("/counts", "/out_of_range")] == expected


def test_raw_histogram_against_a_loop():
    edges = np.array([-1.0, -0.5, 0.0, 0.5, 1.0, 1.5])
    counts = np.array([0, 3, 0, 2, 0])
    raw = raw_histogram(edges, counts)
    values = [-0.25] * 3 + [0.75] * 2  # the bin centres, as often as counted
    assert raw.num == len(values)
    assert raw.sum == pytest.approx(sum(values), rel=1e-15)
    assert raw.sum_squares == pytest.approx(sum(v * v for v in values), rel=1e-15)
    assert (raw.min, raw.max) == (-0.5, 1.0)
    assert raw.bucket_limits == edges.tolist()
    assert raw.bucket_counts == [0, 0, 3, 0, 2, 0]
    empty = raw_histogram(edges, np.zeros(5, dtype=np.int64))
    assert (empty.min, empty.max, empty.num, empty.sum) == (-1.0, 1.5, 0, 0.0)
    with pytest.raises(ValueError, match="bins \\+ 1 edges"):
        raw_histogram(edges, counts[:-1])


def test_histogram_image_against_a_loop():
    counts = np.array([[0, 1, 7], [3, 0, 0]])  # 2 x bins, 3 y bins
    image = histogram_image(counts)
    assert image.shape == (3, 2) and image.dtype == np.uint8
    for row in range(3):
        for column in range(2):
            n = counts[column, 2 - row]
            expected = round(255 * np.log(1 + n) / np.log(1 + 7))
            assert image[row, column] == expected
    assert not histogram_image(np.zeros((2, 3))).any()


def test_tensorboard_sink_writes_every_record(tmp_path):
    sink = TensorBoardSink(tmp_path)
    log = train_with_sinks(sink)
    sink.close()
    assert_written(read_events(tmp_path), log)


class Collect:
    """A sink that keeps what it is given."""

    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def test_log_writes_a_record_once_the_next_arrives_or_at_flush():
    collect = Collect()
    log = DiagnosticsLog([{"step": 0, "loss": 1.0}], sinks=[collect])
    assert collect.records == []
    log.append({"step": 1, "loss": 0.5})
    log.replace(1, {"step": 1, "loss": 0.25})  # not written yet: written once
    log[1]["late"] = 2.0  # as DampedNewton adds its newton/... entries
    log.flush()
    log.flush()
    log.replace(0, {"step": 0, "loss": 0.75})  # written: written again
    assert collect.records == [
        {"step": 0, "loss": 1.0},
        {"step": 1, "loss": 0.25, "late": 2.0},
        {"step": 0, "loss": 0.75},
    ]
    with pytest.raises(TypeError, match=r"write\(record\)"):
        DiagnosticsLog(sinks=[object()])


class MonitoredClassifier(Classifier):
    """The classifier, its DampedNewton monitored, records to the trainer's logger."""

    def configure_optimizers(self):
        sink = LightningLoggerSink(self.logger)
        self.diagnostics = DiagnosticsLog(sinks=[sink])
        monitor = DiagnosticsMonitor(
            specs(), self.model.named_parameters(), log=self.diagnostics
        )
        return DampedNewton(self.parameters(), seed=0, monitor=monitor)

    def on_train_end(self):
        self.diagnostics.flush()  # the last record


def test_lightning_tensorboard_logger_gets_every_record(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="run")
    module = MonitoredClassifier()
    settings = {**TRAINER_SETTINGS, "logger": logger, "log_every_n_steps": 1}
    pl.Trainer(max_steps=STEPS, **settings).fit(module, make_loader())
    assert len(module.diagnostics) == STEPS
    logger.experiment.flush()
    events = read_events(logger.log_dir)
    assert_written(events, module.diagnostics)


def test_lightning_logger_without_histograms(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    with pytest.raises(ValueError, match="arrays=False"):
        LightningLoggerSink(logger)
    log = train_with_sinks(LightningLoggerSink(logger, arrays=False))
    logger.save()
    with open(f"{logger.log_dir}/metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [int(row["step"]) for row in rows] == [record["step"] for record in log]
    for row, record in zip(rows, log, strict=True):
        for key, value in split_record(record).scalars.items():
            assert float(row[key]) == value, key


def test_lightning_logger_sink_refuses_a_trainer_without_logger():
    with pytest.raises(ValueError, match=r"logger=False.*TensorBoardSink"):
        LightningLoggerSink(None, arrays=False)


def test_the_standalone_pytorch_lightning_tensorboard_logger_gets_histograms(tmp_path):
    standalone = pytest.importorskip("pytorch_lightning.loggers")
    logger = standalone.TensorBoardLogger(tmp_path, name="run")
    log = train_with_sinks(LightningLoggerSink(logger))
    logger.experiment.flush()
    assert_written(read_events(logger.log_dir), log)
