"""Orbax checkpoints of a training run: model + optimizer state (with its step), the grain data
iterator, how that data position was saved and a checksum of every state array, saved together
as one ``ocp.args.Composite`` per step.

Each step is ``<workdir>/checkpoints/<step>/{state/, data/, data_meta/, checksums/}``
(``RunDir.checkpoint_dir``), written by orbax (async, keep-last-N). ``data/`` holds one iterator
state per process (grain's ``process_<i>-of-<n>.json``), ``data_meta/`` its ``DataLayout``.
A restore recomputes the checksums (and checks every float array is finite);
``restore_latest_intact`` falls back to the newest step that passes and moves damaged newer
steps aside (``RunDir.damaged_checkpoint_dir``), never deleting them.

A save counts once it is committed: its step directory is final on disk (``poll`` and
``wait`` return the steps committed since the last call). A save that fails raises
``CheckpointError`` naming the step, the cause and the checkpoints that remain, at the first
``poll`` after orbax finished with it, and leaves no partial (tmp) directory behind. Old steps
are deleted (keep-last-N) only after a newer one committed, so a failed save never costs an
earlier checkpoint.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import shutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from ls_jax import sharding as sharding_lib
from ls_jax.training.rundir import CHECKPOINT_SUBDIR, RunDir, remedy

_TMP_MARKER = ".orbax-checkpoint-tmp"
_GRAIN_FILE = re.compile(r"process_\d+-of-(\d+)\.json")  # grain's name for one process's state
_CAUSE_CHARS = 100  # a cause in a one-line message; the whole error goes to the library log
_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='?(\d+)'?\]")
_log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing, empty, unreadable or damaged, or a failed save.
    ``reason``: what is wrong with the step, without naming it. ``kind``: "damaged" (what a
    fallback to an older step answers), "pruned" (the step was deleted while it was read: a
    training run in the directory keeps only its newest steps), "mismatch" (its arrays are not
    the ones the config describes: another run's checkpoint), or None (anything else)."""

    def __init__(self, message: str, reason: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.reason = reason or message
        self.kind = kind


def _leaf_checksum(x):
    """Sum mod 2**32 of the array's bits (exact, independent of reduction order)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return jnp.sum(x.astype(jnp.uint32), dtype=jnp.uint32)


@jax.jit
def _checksums_and_finite(state):
    leaves = jax.tree.leaves(state)
    sums = [_leaf_checksum(x) for x in leaves]
    finite = [jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.bool_(True)
              for x in leaves]
    return sums, finite


def state_checksums(state) -> tuple[dict[str, int], list[str]]:
    """({array path: checksum}, [paths of float arrays holding NaN/inf]) of a state pytree."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    sums, finite = jax.device_get(_checksums_and_finite(state))
    return ({p: int(s) for p, s in zip(paths, sums)},
            [p for p, ok in zip(paths, finite) if not bool(ok)])


def _innermost(e: BaseException) -> BaseException:
    seen = set()
    while id(e) not in seen and (e.__cause__ or e.__context__) is not None:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return e


def _path_key(path) -> str:
    """A pytree path as "a/0/b", whatever the key types (orbax's metadata tree spells an
    integer key as a string)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def _os_errno(e: BaseException) -> int | None:
    """The errno of an OSError, or of the OS error TensorStore names in its message."""
    e = _innermost(e)
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    found = _TENSORSTORE_OS_ERROR.search(str(e))
    return int(found.group(1)) if found else None


def _root_cause(e: BaseException) -> str:
    """The innermost cause of ``e`` as one short line ("PermissionError: [Errno 13] Permission
    denied: '<path>'"; "OSError: [Errno 28] No space left on device" for TensorStore's
    wrapping of an OS error, which names no path)."""
    inner = _innermost(e)
    if isinstance(inner, OSError) and inner.errno is not None:
        path = f": {inner.filename!r}" if inner.filename else ""
        return f"{type(inner).__name__}: [Errno {inner.errno}] {os.strerror(inner.errno)}{path}"
    err = _os_errno(e)
    if err is not None:
        return f"OSError: [Errno {err}] {os.strerror(err)}"
    e = inner
    text = " ".join(str(e).split())
    if len(text) > _CAUSE_CHARS:
        text = text[:_CAUSE_CHARS - 3] + "..."
    return f"{type(e).__name__}: {text}".rstrip(": ")


def _close_unstarted_writes(e: BaseException) -> None:
    """Closes the writes orbax had prepared but not started when a save raised at once.

    Orbax's composite save creates each async item's write (a coroutine) in turn and awaits
    them together; a blocking item that raises first (grain's iterator writer, on a full disk)
    abandons the ones created before it. They never ran, so closing them loses nothing and
    spares the "coroutine ... was never awaited" warning their garbage collection would give.
    """
    tb = e.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            for item in value if isinstance(value, list) else (value,):
                if inspect.iscoroutine(item) and \
                        inspect.getcoroutinestate(item) == inspect.CORO_CREATED:
                    item.close()
        tb = tb.tb_next


class _FirstError(logging.Handler):
    """Keeps the first ERROR record with an exception that orbax logs (a background save's
    failure is logged, and not always raised again)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.error: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is None and record.exc_info and record.exc_info[1] is not None:
            self.error = record.exc_info[1]


@dataclasses.dataclass(frozen=True)
class DataLayout:
    """How a step's data position was saved: one iterator state per process of
    ``process_count``, of the pipeline built from ``pipeline_seed`` (None: not recorded, a
    checkpoint from before ``data_meta/``, whose pipeline used ``data.shuffle_seed``)."""
    process_count: int
    pipeline_seed: int | None


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` with the run's save policy.

    ``run``: the run directory (a ``RunDir`` or its path); checkpoints go to its
    ``checkpoint_dir``.
    """

    def __init__(self, run: RunDir | str, *, keep: int = 3, async_save: bool = True,
                 create: bool = True):
        self.run = run if isinstance(run, RunDir) else RunDir(run)
        self.directory = self.run.checkpoint_dir
        if not create and not os.path.isdir(self.directory):
            raise CheckpointError(
                f"checkpoint: expected a run directory holding '{CHECKPOINT_SUBDIR}/', but "
                f"{self.directory} does not exist")
        # keep-last-N is ours (_prune): orbax's deletes old steps even when the new save failed.
        # The step's directory is made before save() returns: a directory that cannot be made
        # (no write permission, no inodes left) raises its OSError there, at once, instead of
        # failing orbax's background thread while the save waits out its timeout.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=create, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=create,
            async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False))
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self.keep = keep
        self._failed = False
        self._pending: int | None = None  # the step whose save is not verified yet
        self._committed: list[int] = []  # verified since the last poll / wait
        self._orbax_error = _FirstError()
        logging.getLogger("absl").addHandler(self._orbax_error)  # orbax logs through absl

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, state: Any, data_iterator: Any | None = None,
             pipeline_seed: int | None = None) -> None:
        """Starts saving ``step`` (async unless disabled), after verifying the previous save.
        Raises ``CheckpointError`` if that or this save failed.

        data_iterator: this process's grain iterator; its position is saved with its
        ``DataLayout`` (this run's process count and ``pipeline_seed``, the seed it was built
        from)."""
        self._resolve(block=True)
        checksums, _ = state_checksums(state)
        items = {"state": ocp.args.StandardSave(state),
                 "checksums": ocp.args.JsonSave(checksums)}
        if data_iterator is not None:
            import grain
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
            items["data_meta"] = ocp.args.JsonSave(dataclasses.asdict(
                DataLayout(jax.process_count(), pipeline_seed)))
        self._orbax_error.error = None
        self._pending = step
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            self._pending = None
            _close_unstarted_writes(e)
            self._save_failed(step, e)

    def poll(self) -> list[int]:
        """The steps whose saves committed since the last call, without waiting. Raises
        ``CheckpointError`` if the pending save failed."""
        self._resolve(block=False)
        return self._take_committed()

    def wait(self) -> list[int]:
        """``poll`` after waiting for the pending save."""
        self._resolve(block=True)
        return self._take_committed()

    def _take_committed(self) -> list[int]:
        steps, self._committed = self._committed, []
        return steps

    def _resolve(self, block: bool, agree: bool = True) -> None:
        """Verifies the pending save once orbax is done with it (``block``: waits for it).

        agree: with several processes, they decide together (a host collective) when the save
        is done and whether it failed anywhere, so all stop, or delete old steps (a barrier in
        orbax), at the same step."""
        step = self._pending
        if step is None:
            return
        if not block:
            busy = self._manager.is_saving_in_progress()
            if sharding_lib.any_process(busy) if agree else busy:
                return
        self._pending = None
        error = None
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            error = e
        if error is None and not self._is_committed(step):
            error = self._orbax_error.error or CheckpointError(
                f"orbax finished without committing {os.path.join(self.directory, str(step))}")
        if agree and sharding_lib.any_process(error is not None) and error is None:
            error = CheckpointError(f"another process failed to save step {step}")
        if error is not None:
            self._save_failed(step, error)
        self._committed.append(step)
        self._prune()

    def _is_committed(self, step: int) -> bool:
        return os.path.isdir(os.path.join(self.directory, str(step)))

    def committed_steps(self) -> list[int]:
        """The committed steps on disk (not orbax's cached list)."""
        return self.run.checkpoint_steps()

    def _prune(self) -> None:
        """Deletes the oldest committed steps beyond ``keep``."""
        self._manager.reload()
        for old in self.committed_steps()[:-self.keep]:
            self._manager.delete(old)

    def _save_failed(self, step: int, e: BaseException):
        self._failed = True
        _log.error("saving step %d to %s failed", step, self.directory, exc_info=e)
        self._remove_tmp_dirs()
        self._manager.reload()
        left = self.committed_steps()
        then = (f"then rerun the same command to resume from step {left[-1]}" if left else
                "then rerun the same command to start over")
        raise CheckpointError(
            f"checkpoint: saving step {step} to {self.directory} failed ({_root_cause(e)}); "
            f"the checkpoints left there: {left or 'none'}; {remedy(_os_errno(e))}, {then}") from e

    def _remove_tmp_dirs(self) -> None:
        """Partial directories of unfinished saves (never a finished step)."""
        if not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            if _TMP_MARKER in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # -- restoring ----------------------------------------------------------------------------
    def data_layout(self, step: int) -> DataLayout | None:
        """How ``step`` saved its data position; None if it holds none. A step saved before
        ``data_meta/`` existed: the process count from grain's file names, no seed. Unreadable
        metadata raises ``CheckpointError``."""
        step_dir = os.path.join(self.directory, str(step))
        if os.path.isdir(os.path.join(step_dir, "data_meta")):
            try:
                meta = self._manager.restore(
                    step, args=ocp.args.Composite(data_meta=ocp.args.JsonRestore()))["data_meta"]
                return DataLayout(int(meta["process_count"]), meta["pipeline_seed"])
            except Exception as e:
                reason = f"unreadable data_meta: {_root_cause(e)}"
                raise CheckpointError(f"checkpoint: step {step} in {self.directory} could not be "
                                      f"restored ({reason})", reason) from e
        data_dir = os.path.join(step_dir, "data")
        counts = {int(m.group(1)) for name in (os.listdir(data_dir) if os.path.isdir(data_dir)
                                               else ()) if (m := _GRAIN_FILE.fullmatch(name))}
        return DataLayout(counts.pop(), None) if len(counts) == 1 else None

    def restore(self, step: int | None, abstract_state: Any, data_iterator: Any | None = None,
                *, partial: bool = False):
        """Restores ``state`` (and the iterator in place) at ``step`` (None: the latest) and
        verifies it; a damaged step raises ``CheckpointError``, and so does a data position
        saved by another number of processes (each process's input shard differs).

        partial: ``abstract_state`` names a part of the saved state (a subset of its keys); only
        that part is read from disk (and verified).
        """
        for attempt in range(3):  # the latest step, read while a training run prunes
            self._manager.reload()
            steps = self.all_steps()
            if not steps:
                raise CheckpointError(
                    f"checkpoint: no finished checkpoint in {self.directory} (the directory is "
                    f"empty or holds only unfinished saves)")
            chosen = steps[-1] if step is None else step
            if chosen not in steps:
                raise CheckpointError(
                    f"checkpoint: expected a step in {steps} for {self.directory}, got {chosen}")
            try:
                layout = self.data_layout(chosen) if data_iterator is not None else None
                return self._restore(chosen, abstract_state, data_iterator, layout, partial)
            except CheckpointError as e:
                if e.kind != "pruned" or step is not None or attempt == 2:
                    raise

    def _restore(self, step: int, abstract_state: Any, data_iterator: Any | None,
                 layout: DataLayout | None, partial: bool):
        """``restore`` of an existing ``step`` whose ``data_layout`` the caller has read."""
        step_dir = os.path.join(self.directory, str(step))
        self._check_shapes(step, abstract_state, partial)
        has_checksums = os.path.isdir(os.path.join(step_dir, "checksums"))
        if partial:
            items = {"state": ocp.args.PyTreeRestore(
                item=abstract_state, partial_restore=True,
                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))}
        else:
            items = {"state": ocp.args.StandardRestore(abstract_state)}
        if has_checksums:
            items["checksums"] = ocp.args.JsonRestore()
        if data_iterator is not None:
            import grain
            if layout is not None and layout.process_count != jax.process_count():
                raise CheckpointError(
                    f"checkpoint: the data position of step {step} in {self.directory} was saved "
                    f"by {layout.process_count} process(es), this run has {jax.process_count()}; "
                    f"restore the state without it")
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax raises many types for damaged directories
            if not os.path.isdir(step_dir):
                raise self._pruned(step) from e
            reason = f"unreadable: {_root_cause(e)}"
            raise CheckpointError(f"checkpoint: step {step} in {self.directory} could not be "
                                  f"restored (truncated or damaged? {_root_cause(e)})",
                                  reason, "damaged") from e
        state = restored["state"]
        sums, non_finite = state_checksums(state)
        if has_checksums:
            expected = dict(restored["checksums"])
            bad = [p for p in sums if expected.get(p) != sums[p]]
            if bad or (not partial and set(sums) != set(expected)):
                reason = f"checksum mismatch in {len(bad)} array(s), first {bad[:1]}"
                raise CheckpointError(
                    f"checkpoint: step {step} in {self.directory} is damaged: {reason}", reason,
                    "damaged")
        if non_finite:
            reason = f"non-finite values in {len(non_finite)} array(s), first {non_finite[0]}"
            raise CheckpointError(
                f"checkpoint: step {step} in {self.directory} is damaged: {reason}", reason,
                "damaged")
        return step, state

    def _pruned(self, step: int) -> CheckpointError:
        self._manager.reload()
        return CheckpointError(
            f"checkpoint: step {step} in {self.directory} was deleted while it was read (a "
            f"training run in that directory keeps only its newest train.keep_checkpoints "
            f"steps; those there now: {self.committed_steps() or 'none'}); read one of those",
            "deleted while it was read", "pruned")

    def _check_shapes(self, step: int, abstract_state: Any, partial: bool) -> None:
        """Raises ``CheckpointError`` (kind "mismatch") if ``step``'s saved state holds other
        arrays, or arrays of other shapes, than ``abstract_state`` (all of them; with
        ``partial``, those it names): a checkpoint of another config, not a damaged one. A
        step whose metadata cannot be read is left to the restore to report."""
        try:
            from etils import epath
            saved = ocp.PyTreeCheckpointHandler().metadata(
                epath.Path(self.directory) / str(step) / "state")
            saved = {_path_key(p): tuple(m.shape) for p, m in
                     jax.tree_util.tree_flatten_with_path(saved)[0] if hasattr(m, "shape")}
        except Exception:  # noqa: BLE001  damaged metadata: the restore names it
            if not os.path.isdir(os.path.join(self.directory, str(step))):
                raise self._pruned(step) from None
            return
        wanted = {_path_key(p): tuple(x.shape)
                  for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
        if not saved:
            return
        missing = sorted(set(wanted) - set(saved))
        extra = [] if partial else sorted(set(saved) - set(wanted))
        differ = sorted(p for p in set(wanted) & set(saved) if wanted[p] != saved[p])
        if not (missing or extra or differ):
            return
        if differ:
            what = (f"{len(differ)} array(s) of other shapes, first {differ[0]}: saved "
                    f"{saved[differ[0]]}, the config's {wanted[differ[0]]}")
        else:
            what = (f"other arrays ({len(missing)} of the config's missing, first "
                    f"{(missing or ['-'])[0]}; {len(extra)} not in the config)")
        raise CheckpointError(
            f"checkpoint: step {step} in {self.directory} does not match the config's model "
            f"({what}): it was written with another config; use the config.json of the run "
            f"it belongs to, or another directory", f"shapes differ from the config: {what}",
            "mismatch")

    def restore_latest_intact(self, abstract_state: Any,
                              data_iterator_for: Callable[[int, DataLayout | None], Any] | None
                              = None, log: Callable[[str], None] = print):
        """(step, state) of the newest step that restores and verifies, or (None, None) if
        there is no checkpoint. Each damaged newer step gets a one-line warning and is moved to
        ``RunDir.damaged_checkpoint_dir`` (kept, so a new save of that step is possible).

        data_iterator_for: called with each step tried (newest first) and its ``data_layout``;
        returns the iterator to restore that step's data position into, or None to restore the
        state only (e.g. a position saved by another number of processes).
        """
        steps = self.all_steps()
        if not steps:
            return None, None
        damaged = []
        for step in reversed(steps):
            try:
                layout = data_iterator = None
                if data_iterator_for is not None:  # the layout is read once per step tried
                    layout = self.data_layout(step)
                    data_iterator = data_iterator_for(step, layout)
                step, state = self._restore(step, abstract_state, data_iterator, layout,
                                            partial=False)
            except CheckpointError as e:
                if e.kind == "mismatch":  # the same config fails every step: not damage
                    raise
                _log.warning("%s", e, exc_info=e.__cause__)  # the whole error, to the log file
                if e.kind != "pruned":  # a deleted step is not damaged: nothing to move
                    damaged.append((step, e))
                continue
            for bad_step, err in damaged:
                dest = self._move_aside(bad_step)
                log(f"warning: checkpoint: step {bad_step} is damaged ({err.reason}); moved to "
                    f"{dest}, resuming from step {step}")
            if damaged:
                self._manager.reload()
            return step, state
        raise CheckpointError(
            f"checkpoint: no intact checkpoint in {self.directory} (steps {steps} are all "
            f"damaged; step {damaged[0][0]}: {damaged[0][1].reason}); nothing was moved or "
            f"deleted")

    def _move_aside(self, step: int) -> str:
        os.makedirs(self.run.damaged_checkpoint_dir, exist_ok=True)
        dest = os.path.join(self.run.damaged_checkpoint_dir, str(step))
        n = 1
        while os.path.exists(dest):
            dest = os.path.join(self.run.damaged_checkpoint_dir, f"{step}.{n}")
            n += 1
        os.replace(os.path.join(self.directory, str(step)), dest)
        return dest

    def close(self) -> None:
        """Waits for a pending save; raises ``CheckpointError`` if it failed (once)."""
        try:
            # raises only a failure not reported yet; no collective (other processes may not
            # be closing: this one can be here because of an error of its own)
            self._resolve(block=True, agree=False)
        finally:
            logging.getLogger("absl").removeHandler(self._orbax_error)
            try:
                self._manager.close()
            except Exception:
                if not self._failed:
                    raise
