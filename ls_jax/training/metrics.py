"""Metric logging: the logit-norm collector's summaries, JSONL and TensorBoard event files, and
where the libraries' own log records go.

Both logs are append-only; a write cut short (a full disk, a kill) can leave a partial last
record, which a resumed run removes (one warning line) before it appends.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from ls_jax.training.rundir import WriteFailed, write_atomically, write_failed

# TensorBoard rereads its event files every 5 s by default (--reload_interval): flushing them
# (an fsync, which waits on every other writer of the disk) more often shows nothing sooner.
TENSORBOARD_FLUSH_S = 5.0


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
    """The records of a JSONL log; a partial last record (a cut-short append) is left out. A
    damaged record before the last raises ValueError naming the file and line."""
    return _read_jsonl(path)[0]


def _read_jsonl(path: str) -> tuple[list[dict], int]:
    """(records, bytes of a partial last record, 0 if none)."""
    if not os.path.exists(path):
        return [], 0
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as e:
            if i == len(lines) - 1:  # no newline after it: an append that did not finish
                return records, len(line)
            raise ValueError(f"metrics: line {i + 1} of {path} is not a JSON record ({e}); "
                             f"restore the file or delete that line") from None
    return records, 0


def _repair_event_file(path: str) -> int:
    """Cuts a TensorBoard event file (TFRecord framing: length, its CRC, data, data CRC) after
    its last whole record; returns the bytes removed."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + 12 <= size:
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        if pos + 12 + length + 4 > size:
            break
        pos += 12 + length + 4
    if pos < size:
        os.truncate(path, pos)
    return size - pos


def _masked_crc32c(data: bytes) -> int:
    """The checksum TFRecord framing stores: CRC-32C, rotated and offset."""
    from tensorboardX.crc32c import crc32c
    x = crc32c(data) & 0xFFFFFFFF
    return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _tfrecord(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", _masked_crc32c(header)) + data
            + struct.pack("<I", _masked_crc32c(data)))


_CLOSE = object()  # asks the events thread to flush, close the file and end


class EventsWriter:
    """TensorBoard scalars appended to a new events file in ``directory`` by a thread of its
    own, which also flushes the file (with an fsync) at most every ``TENSORBOARD_FLUSH_S``
    seconds: the caller never waits on the disk, and never blocks on the thread either (its
    queue is unbounded; a record is a few hundred bytes per logged step). A write or flush that
    fails (a full disk) ends the thread; the caller's next ``add``, ``flush`` or ``check``
    raises ``WriteFailed`` naming the file.

    ``purge_step``: events of this step and later, in the directory's older files, are hidden
    from TensorBoard (a SessionLog START at that step: what a resumed run logs again)."""

    def __init__(self, directory: str, purge_step: int | None = None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
        self._event, self._summary = Event, Summary
        base = os.path.join(directory, f"events.out.tfevents.{int(time.time())}."
                                       f"{socket.gethostname()}")
        self.path, n = base, 0
        try:
            os.makedirs(directory, exist_ok=True)
            while True:  # a new file, never one of an earlier run started in the same second
                try:
                    self._file = open(self.path, "xb")
                    break
                except FileExistsError:
                    n += 1
                    self.path = f"{base}.{n}"
        except OSError as e:
            raise write_failed(self.path, e) from e
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="tensorboard-events", daemon=True)
        self._thread.start()
        self._put(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._put(Event(step=purge_step, wall_time=time.time(),
                            session_log=SessionLog(status=SessionLog.START)))

    def add(self, step: int, scalars: list[tuple[str, float]]) -> None:
        """Queues one event holding ``scalars`` ((tag, value) pairs) at ``step``."""
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in scalars]
        self._put(self._event(step=int(step), wall_time=time.time(),
                              summary=self._summary(value=values)))

    def _put(self, event) -> None:
        self.check()
        self._queue.put(_tfrecord(event.SerializeToString()))

    def check(self) -> None:
        """Raises ``WriteFailed`` if a write or flush of the file failed."""
        if self._error is not None:
            raise write_failed(self.path, self._error) from self._error
        if not self._thread.is_alive():
            raise WriteFailed(f"could not write {self.path} (it is closed)")

    def flush(self) -> None:
        """Waits until every event queued so far is on disk."""
        self.check()
        done = threading.Event()
        self._queue.put(done)
        while not done.wait(0.1):  # a signal's handler runs between the waits
            if not self._thread.is_alive():
                break
        self.check()

    def close(self) -> None:
        """Writes what is queued and closes the file; a failure here is not raised (``flush``
        raises it in a run that ends normally)."""
        if self._thread.is_alive():
            self._queue.put(_CLOSE)
            while self._thread.is_alive():
                self._thread.join(0.1)

    def _run(self) -> None:
        pending, due = False, None
        try:
            while True:
                try:
                    item = self._queue.get(timeout=None if due is None else
                                           max(0.0, due - time.monotonic()))
                except queue.Empty:
                    item = None  # the periodic flush is due
                if isinstance(item, bytes):
                    self._file.write(item)
                    if not pending:
                        pending, due = True, time.monotonic() + TENSORBOARD_FLUSH_S
                    continue
                if pending:
                    self._file.flush()
                    os.fsync(self._file.fileno())
                    pending, due = False, None
                if item is _CLOSE:
                    self._file.close()
                    return
                if item is not None:
                    item.set()
        except OSError as e:
            self._error = e
            try:
                self._file.close()  # its buffered bytes are lost: the resume cuts a torn record
            except OSError:
                pass


class MetricsWriter:
    """Appends one JSON record per logged step to the JSONL file ``path`` and, with
    ``tensorboard_dir``, writes the same numbers as TensorBoard scalars there (a run's paths:
    ``RunDir.metrics_path`` and ``RunDir.tensorboard_dir``).

    ``resume_step``: records of steps after it (logged by a run that was killed before its next
    checkpoint) are dropped (in the JSONL file and TensorBoard alike; those of ``resume_step``
    itself stay), so a resumed run does not log those steps twice; a partial last record in
    either is removed, with one ``warn`` line. Without it, an existing log is moved aside to
    ``<path>.old`` (a fresh run keeps, but does not mix, old logs).

    ``metrics.jsonl`` is flushed at every record; the TensorBoard events (``EventsWriter``)
    at most every ``TENSORBOARD_FLUSH_S`` seconds, at ``flush()`` and at ``close()``. A failed
    write or flush (a full disk) raises ``WriteFailed`` naming the file: at once for
    ``metrics.jsonl``, at the next ``write``, ``flush`` or ``check`` for the events.
    """

    def __init__(self, path: str, *, tensorboard_dir: str | None = None,
                 resume_step: int | None = None, enabled: bool = True,
                 warn: Callable[[str], None] = print):
        self.path = path
        self.enabled = enabled
        self._tb = None
        self._tb_dir = tensorboard_dir
        if not enabled:
            return
        self.records: list[dict] = []  # the records kept from an earlier run (on resume)
        if resume_step is not None:
            self._repair(resume_step, warn)
        try:
            if resume_step is None and os.path.exists(self.path):
                os.replace(self.path, self.path + ".old")
            self._file = open(self.path, "a")
        except OSError as e:
            raise write_failed(self.path, e) from e
        if tensorboard_dir is not None:
            # events after the resumed step are dropped; the resumed step's own are kept
            self._tb = EventsWriter(tensorboard_dir,
                                    None if resume_step is None else resume_step + 1)

    def _repair(self, resume_step: int, warn) -> None:
        """Keeps the records up to ``resume_step``; removes partial last records."""
        torn = []
        if os.path.exists(self.path):
            records, partial = _read_jsonl(self.path)
            self.records = [r for r in records if r.get("step", 0) <= resume_step]
            if partial:
                torn.append(f"{self.path} ({partial} bytes)")
            write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        if self._tb_dir is not None and os.path.isdir(self._tb_dir):
            for name in sorted(os.listdir(self._tb_dir)):
                events = os.path.join(self._tb_dir, name)
                if name.startswith("events.out.tfevents") and os.path.isfile(events):
                    if removed := _repair_event_file(events):
                        torn.append(f"{events} ({removed} bytes)")
        if torn:
            warn(f"warning: removed the partial last record of {' and '.join(torn)}, left by "
                 f"a write that did not finish")

    def has_record(self, step: int, key: str) -> bool:
        """Whether a kept record of ``step`` holds ``key`` (e.g. a finished run's final eval)."""
        return any(r.get("step") == step and key in r for r in self.records)

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{prefix + k: v for k, v in metrics.items()}}
        try:
            self._file.write(json.dumps(record, allow_nan=True) + "\n")
            self._file.flush()
        except OSError as e:
            raise write_failed(self.path, e) from e
        if self._tb is not None:
            self._tb.add(step, [(prefix + tag, value) for tag, value in _scalars(metrics)
                                if math.isfinite(value)])

    def flush(self) -> None:
        """Puts the TensorBoard events written so far on disk (``metrics.jsonl`` is, at every
        record)."""
        if self.enabled and self._tb is not None:
            self._tb.flush()

    def check(self) -> None:
        """Raises ``WriteFailed`` if a write of the TensorBoard events or of the library log
        (``send_library_logs_to``) failed since the last call; cheap enough for every step."""
        if self.enabled and self._tb is not None:
            self._tb.check()
        check_library_log()

    def close(self) -> None:
        """Closes both logs, flushing the TensorBoard events. A write that fails here is not
        raised: a run that ends normally calls ``flush()`` first, which raises it, so one here
        follows an error already raised (a resume repairs the logs)."""
        if not self.enabled:
            return
        try:
            self._file.close()
        except OSError:
            pass
        if self._tb is not None:
            self._tb.close()


# -- the libraries' log records ----------------------------------------------------------------

class _NoTraceback(logging.Filter):
    """Drops a record's traceback (its own line stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


class _LibraryLogFile(logging.FileHandler):
    """The library log's file: a record that cannot be written (a full disk) is kept as the
    error ``check_library_log`` raises, not reported on stderr."""

    error: OSError | None = None

    def handleError(self, record: logging.LogRecord) -> None:
        e = sys.exc_info()[1]
        if isinstance(e, OSError) and _LibraryLogFile.error is None:
            _LibraryLogFile.error = e
            _LibraryLogFile.failed_path = self.baseFilename


def check_library_log() -> None:
    """Raises ``WriteFailed`` (once) if a record of the library log could not be written."""
    e = _LibraryLogFile.error
    if e is not None:
        _LibraryLogFile.error = None
        raise write_failed(_LibraryLogFile.failed_path, e) from e


def send_library_logs_to(path: str | None, *, echo: bool = False,
                         required: bool = False) -> str | None:
    """Routes the Python log records of the libraries (orbax and grain through absl, asyncio,
    jax, Python warnings) to the file ``path`` (appended; its directory is made) instead of the
    terminal: a failed save or a damaged checkpoint leaves its tracebacks there. ``echo``
    (``--debug``) also shows them on stderr. Returns ``path``, or None when there is none or it
    cannot be opened (the records then stay on stderr, one line each, without tracebacks).
    Calling it again replaces the routing. ``required``: a file that cannot be opened raises
    ``WriteFailed`` instead (a training run writes its directory; an evaluation may read a
    read-only one).

    A record that cannot be written (a full disk) is not reported on stderr: the next
    ``check_library_log`` (a training run calls it after every step) raises it.
    """
    root = logging.getLogger()
    for h in list(root.handlers):  # a library's logging.basicConfig(), or an earlier call
        if type(h) is logging.StreamHandler or getattr(h, "_ls_jax", False):
            root.removeHandler(h)
            if isinstance(h, logging.FileHandler):
                h.close()
    handlers: list[logging.Handler] = []
    written = None
    _LibraryLogFile.error = None
    if path is not None:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            handlers.append(_LibraryLogFile(path))
            written = path
        except OSError as e:
            if required:
                raise write_failed(path, e) from e
    if echo or written is None:
        handlers.append(logging.StreamHandler(sys.stderr))
        if not echo:
            handlers[-1].addFilter(_NoTraceback())
    for h in handlers:
        h._ls_jax = True
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(h)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    logging.captureWarnings(True)
    logging.raiseExceptions = echo
    return written
