"""Orbax checkpoints of a training run: model + optimizer state (with its step), the grain data
iterator, how that data position was saved and a checksum of every state array, saved together
as one ``ocp.args.Composite`` per step.

Each step is ``<workdir>/checkpoints/<step>/{state/, data/, data_meta/, checksums/}``
(``RunDir.checkpoint_dir``), written by orbax (async, keep-last-N). ``data/`` holds one iterator
state per process (grain's ``process_<i>-of-<n>.json``), ``data_meta/`` its ``DataLayout``.
A restore recomputes the checksums (and checks every float array is finite);
``restore_latest_intact`` falls back to the newest step that passes and moves damaged newer
steps aside (``RunDir.damaged_checkpoint_dir``), never deleting them. A failed save raises
``CheckpointError`` naming the cause at the next ``save`` or ``check_for_errors`` and leaves no
partial (tmp) directory behind.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from ls_jax.rundir import CHECKPOINT_SUBDIR, RunDir

_TMP_MARKER = ".orbax-checkpoint-tmp"
_GRAIN_FILE = re.compile(r"process_\d+-of-(\d+)\.json")  # grain's name for one process's state


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing, empty, unreadable or damaged, or a failed save."""


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


def _root_cause(e: BaseException) -> str:
    """The innermost cause of ``e`` as one line ("OSError: [Errno 28] No space left...")."""
    seen = set()
    while id(e) not in seen and (e.__cause__ or e.__context__) is not None:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


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
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=create, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=create)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._failed = False

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, state: Any, data_iterator: Any | None = None,
             pipeline_seed: int | None = None) -> None:
        """Starts saving ``step`` (async unless disabled). Raises ``CheckpointError`` if this or
        an earlier async save failed.

        data_iterator: this process's grain iterator; its position is saved with its
        ``DataLayout`` (this run's process count and ``pipeline_seed``, the seed it was built
        from)."""
        self.check_for_errors()
        checksums, _ = state_checksums(state)
        items = {"state": ocp.args.StandardSave(state),
                 "checksums": ocp.args.JsonSave(checksums)}
        if data_iterator is not None:
            import grain
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
            items["data_meta"] = ocp.args.JsonSave(dataclasses.asdict(
                DataLayout(jax.process_count(), pipeline_seed)))
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            self._save_failed(e, step)

    def check_for_errors(self) -> None:
        """Raises ``CheckpointError`` (one line naming the cause) if an async save failed."""
        try:
            self._manager.check_for_errors()
        except Exception as e:
            self._save_failed(e, None)

    def _save_failed(self, e: BaseException, step: int | None):
        self._failed = True
        self._remove_tmp_dirs()
        what = f"step {step}" if step is not None else "a checkpoint"
        raise CheckpointError(f"checkpoint: saving {what} to {self.directory} failed "
                              f"({_root_cause(e)}); the run stopped, earlier checkpoints are "
                              f"intact") from e

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
                raise CheckpointError(
                    f"checkpoint: step {step} in {self.directory} could not be restored (its "
                    f"data_meta is damaged): {_root_cause(e)}") from e
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
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(
                f"checkpoint: no finished checkpoint in {self.directory} (the directory is empty "
                f"or holds only unfinished saves)")
        if step is None:
            step = steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"checkpoint: expected a step in {steps} for {self.directory}, got {step}")
        layout = self.data_layout(step) if data_iterator is not None else None
        return self._restore(step, abstract_state, data_iterator, layout, partial)

    def _restore(self, step: int, abstract_state: Any, data_iterator: Any | None,
                 layout: DataLayout | None, partial: bool):
        """``restore`` of an existing ``step`` whose ``data_layout`` the caller has read."""
        step_dir = os.path.join(self.directory, str(step))
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
            raise CheckpointError(
                f"checkpoint: step {step} in {self.directory} could not be restored (truncated or "
                f"damaged?): {_root_cause(e)}") from e
        state = restored["state"]
        sums, non_finite = state_checksums(state)
        if has_checksums:
            expected = dict(restored["checksums"])
            bad = [p for p in sums if expected.get(p) != sums[p]]
            if bad or (not partial and set(sums) != set(expected)):
                raise CheckpointError(
                    f"checkpoint: step {step} in {self.directory} is damaged: checksum mismatch "
                    f"in {len(bad)} array(s), first {bad[:1]}")
        if non_finite:
            raise CheckpointError(
                f"checkpoint: step {step} in {self.directory} is damaged: non-finite values in "
                f"{len(non_finite)} array(s), first {non_finite[0]}")
        return step, state

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
                damaged.append((step, e))
                continue
            for bad_step, err in damaged:
                dest = self._move_aside(bad_step)
                log(f"warning: {err}; moved to {dest}, resuming from step {step}")
            if damaged:
                self._manager.reload()
            return step, state
        raise CheckpointError(
            f"checkpoint: no intact checkpoint in {self.directory} (steps {steps} are all "
            f"damaged; newest: {damaged[0][1]}); nothing was moved or deleted")

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
        reported = self._failed
        try:
            self._manager.wait_until_finished()
            self.check_for_errors()
        except CheckpointError:
            if not reported:
                raise
        except Exception as e:
            if not reported:
                self._save_failed(e, None)
        finally:
            self._manager.close()
