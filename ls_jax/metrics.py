"""Metric logging: the logit-norm collector's summaries, JSONL and TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


def logit_norm_summary(attn_max_abs_logit_LxH, lm_head_max_abs_logit) -> dict[str, Any]:
    """Turns the per-layer, per-head max |pre-softmax logit| into loggable values.

    Returns the full [L][H] table, per-layer maxima, the max over all heads and layers, and the
    LM head's max |logit|.
    """
    table = np.asarray(attn_max_abs_logit_LxH, dtype=np.float64)
    return {
        "attn_max_abs_logit": table.tolist(),
        "attn_max_abs_logit_per_layer": table.max(axis=1).tolist(),
        "max_abs_logit": float(table.max()),
        "lm_head_max_abs_logit": float(np.asarray(lm_head_max_abs_logit)),
    }


def _scalars(metrics: dict[str, Any]):
    """(tag, value) pairs for TensorBoard: plain numbers and the per-layer/head tables."""
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, float(value)
        elif key == "attn_max_abs_logit":
            for l, row in enumerate(value):
                for h, v in enumerate(row):
                    yield f"max_abs_logit/layer{l}/head{h}", float(v)
        elif key == "attn_max_abs_logit_per_layer":
            for l, v in enumerate(value):
                yield f"max_abs_logit/layer{l}", float(v)


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends one JSON record per logged step to the JSONL file ``path`` and, with
    ``tensorboard_dir``, writes the same numbers as TensorBoard scalars there (a run's paths:
    ``RunDir.metrics_path`` and ``RunDir.tensorboard_dir``).

    ``resume_step``: records of steps after it (logged by a run that was killed before its next
    checkpoint) are dropped, so a resumed run does not log those steps twice. Without it, an
    existing log is moved aside to ``<path>.old`` (a fresh run keeps, but does not mix, old logs).
    """

    def __init__(self, path: str, *, tensorboard_dir: str | None = None,
                 resume_step: int | None = None, enabled: bool = True):
        self.path = path
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        if resume_step is not None and os.path.exists(self.path):
            kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(tmp, self.path)
        elif resume_step is None and os.path.exists(self.path):
            os.replace(self.path, self.path + ".old")
        self._file = open(self.path, "a")
        if tensorboard_dir is not None:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(tensorboard_dir, purge_step=resume_step)

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{prefix + k: v for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for tag, value in _scalars(metrics):
                if math.isfinite(value):
                    self._tb.add_scalar(prefix + tag, value, step)
            self._tb.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
