"""The demo's summary chart: every label inside the figure, the disk-size ratio apart from the
speed-ups, every stage charted or named, the host load in the title."""
from __future__ import annotations

import pytest

from latentfast.demo import chart_figure

STAGES = {
    "images": {"metric": "images/s", "value": 812.0, "ratio_label": ""},
    "cache": {"metric": "lines/s", "value": 90.0, "ratio": 1.93, "ratio_label": "disk: padded / ragged", "ratio_kind": "disk size"},
    "train": {"metric": "batches/s", "value": 40.0, "ratio": 31.4,
              "ratio_label": "read_batch vs per-row reader, both allocate their batch (a long label that used to run off the axes)"},
    "normalize": {"metric": "GB/s", "value": 3.0, "ratio": 2.5, "ratio_label": "fused op vs per-view eager"},
    "balance": {"error": "RuntimeError: gloo timed out"},
    "replay": {"metric": "max rel. grad error", "value": 0.0, "ratio_label": "replayed gradient equals plain backprop"},
}


def test_chart_keeps_labels_inside_and_says_what_is_missing():
    """Before: the ratio labels ran past the axes, the disk ratio shared the speed-up axis, stages
    without a ratio vanished silently, and the load was not shown."""
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = chart_figure(STAGES, plt, load=3.25)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    texts = [*fig.texts, fig._suptitle]
    for axis in fig.axes:  # the labels the chart writes (not numeric ticks beyond the view, never drawn)
        texts += [*axis.texts, axis.xaxis.label, *axis.get_yticklabels()]
    texts = [t for t in texts if t.get_text()]
    for text in texts:
        extent = text.get_window_extent(renderer)
        assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1 and box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1, text.get_text()
    speed_ax, disk_ax = fig.axes
    assert [t.get_text() for t in speed_ax.get_yticklabels()] == ["train", "normalize"]
    assert [t.get_text() for t in disk_ax.get_yticklabels()] == ["cache"] and "disk size" in disk_ax.get_xlabel()
    for axis in fig.axes:  # the value labels lie inside their axes
        for text in axis.texts:
            assert text.get_window_extent(renderer).x1 <= axis.get_window_extent(renderer).x1 + 1, text.get_text()
    words = " ".join(t.get_text() for t in texts)
    assert "balance: FAILED" in words and "images: not charted" in words and "replay: not charted" in words
    assert "load average 3.2" in words or "load average 3.3" in words
    plt.close(fig)
