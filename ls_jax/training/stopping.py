"""When a training run stops early: SIGTERM or SIGINT (Ctrl-C), a step count, a wall-clock time
(``Stopper``, whose signal handlers cover the whole run), and ``Interrupted``, what a second
signal raises. ``ls_jax.training.train`` asks it at each point where nothing is lost."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

import jax

from ls_jax import sharding as sharding_lib

# A second signal waits this long for a checkpoint being written (a save of a small model
# commits well within it), then ends the process anyway: a stop asked twice is never long.
SECOND_SIGNAL_WAIT_S = 5.0
# After a first signal, a save whose partial directory did not change for this long is stalled
# (a hung disk): the process ends, keeping the checkpoints already committed.
STALLED_SAVE_S = 10.0


class Interrupted(KeyboardInterrupt):
    """A second signal stopped the run at once: the message names the last checkpoint."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class Stopper:
    """Why to stop early: SIGTERM or SIGINT (Ctrl-C), a step count, a wall-clock time. Its
    handlers cover the whole run.

    A first signal only asks: the run stops at the next point where nothing is lost (a
    start-up check, the end of a step, a batch of the final eval). A second signal raises
    KeyboardInterrupt at once, except inside ``commit()`` (a checkpoint being written or
    verified), whose end it waits for.

    exit_with: (line of a second signal, line of a stalled save), each given the signal's name:
    the signals are then counted by a thread of their own, from the interpreter's wakeup fd
    (one byte per signal delivered: two signals in quick succession count as two even while
    the main thread is inside one native call). That thread ends the process at a second signal
    (after the checkpoint being written, for at most ``SECOND_SIGNAL_WAIT_S``) and at a save
    stalled after a first one; the main thread's handlers do nothing.
    """

    def __init__(self, after_steps: int | None, at_time: float | None, *,
                 exit_with: tuple[Callable[[str], str], Callable[[str], str]] | None = None,
                 checkpoint_dir: str | None = None):
        self.after_steps, self.at_time = after_steps, at_time
        self.signum = None
        self._ran = 0
        self._old = {}
        self._committing = 0
        self._deferred = False  # a second signal arrived inside commit()
        self._exit_with, self._checkpoint_dir = exit_with, checkpoint_dir
        self._wakeup = None  # (read fd, write fd, the wakeup fd before ours)
        self._exiting = False  # the watching thread is ending the process

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no signal handling
                pass
        if self._old and self._exit_with is not None:
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._wakeup = (r, w, signal.set_wakeup_fd(w, warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(r,), name="signals", daemon=True).start()
        return self

    def _handle(self, signum, frame):
        if self._wakeup is not None:  # the watching thread counts it; the stop is asked now
            if self.signum is None:
                self.signum = signum
            return
        if self.signum is None:
            self.signum = signum
        elif self._committing:
            self._deferred = True
        else:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._wakeup is not None:
            r, w, old = self._wakeup
            signal.set_wakeup_fd(old)
            os.close(w)  # the watching thread reads the end of the pipe and returns
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _watch(self, fd: int) -> None:
        """The signal-watching thread of ``exit_with``."""
        stopping = (signal.SIGTERM, signal.SIGINT)
        seen, since = None, None  # the partial saves' (files, bytes), and since when
        count = 0
        try:
            while True:
                ready, _, _ = select.select([fd], [], [], 1.0)
                data = os.read(fd, 64) if ready else b""
                if ready and not data:
                    return  # the run ended
                for signum in data:
                    if signum not in stopping:
                        continue
                    count += 1
                    if self.signum is None:
                        self.signum = signum
                    if count >= 2:
                        self._exit(signum, self._exit_with[0], SECOND_SIGNAL_WAIT_S)
                if self.signum is None or not self._committing:
                    seen, since = None, None
                    continue
                now = self._partial_saves()
                if now != seen:
                    seen, since = now, time.monotonic()
                elif time.monotonic() - since >= STALLED_SAVE_S:
                    self._exit(self.signum, self._exit_with[1], 0.0)
        finally:
            os.close(fd)

    def _partial_saves(self) -> tuple[int, int]:
        """(files, bytes) under the unfinished saves' directories: what a save's progress
        changes."""
        files = size = 0
        root = self._checkpoint_dir
        try:
            names = [n for n in os.listdir(root) if not n.isdigit()]
        except OSError:
            return 0, 0
        for name in names:
            files += 1  # the directory itself, made before anything is written into it
            for parent, _, children in os.walk(os.path.join(root, name)):
                for child in children:
                    with contextlib.suppress(OSError):
                        size += os.path.getsize(os.path.join(parent, child))
                    files += 1
        return files, size

    def _exit(self, signum: int, line: Callable[[str], str], wait_s: float) -> None:
        """Ends the process with ``line`` once no checkpoint is being written (in the main
        thread or in the background: an unfinished save's directory), for at most
        ``wait_s``."""
        self._exiting = True  # the main thread starts no new save (``commit``)
        deadline = time.monotonic() + wait_s
        while (self._committing or self._partial_saves()[0]) and time.monotonic() < deadline:
            time.sleep(0.02)
        message = f"error: {line(signal.Signals(signum).name)}\n"
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.write(2, message.encode())
        os._exit(128 + signum)

    @contextlib.contextmanager
    def commit(self):
        """A block a second signal does not cut short (it acts at the block's end; with
        ``exit_with`` it waits at most ``SECOND_SIGNAL_WAIT_S``)."""
        while self._exiting:  # the watching thread ends the process: start nothing new
            time.sleep(1.0)
        self._committing += 1
        try:
            yield
        finally:
            self._committing -= 1
        if self._deferred and not self._committing:
            self._deferred = False
            raise KeyboardInterrupt

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "no signal"

    def requested(self) -> bool:
        """Whether a signal asked for a stop."""
        return self.signum is not None

    def at_startup(self) -> str | None:
        """The signal that asked for a stop before the first step, or None. With several
        processes None: they stop together after the first step (``after_step``)."""
        if self.signum is None or jax.process_count() > 1:
            return None
        return self.signal_name

    def after_step(self) -> str | None:
        """The reason to stop now, or None. With several processes they agree: a SIGTERM
        reaches hosts at different steps, and all stop (and save) at the first step after
        any of them saw it."""
        why = self._local_reason()
        if sharding_lib.any_process(why is not None) and why is None:
            why = "another process is stopping"
        return why

    def _local_reason(self) -> str | None:
        self._ran += 1
        if self.signum is not None:
            return self.signal_name
        if self.after_steps is not None and self._ran >= self.after_steps:
            return f"stop_after_steps={self.after_steps}"
        if self.at_time is not None and time.time() >= self.at_time:
            return "time budget"
        return None
