"""Orbax checkpoints of a training run: model + optimizer state (with its step) and the grain
data iterator, saved together as one ``ocp.args.Composite`` per step.

Each step is ``<workdir>/checkpoints/<step>/{state/, data/}`` (``RunDir.checkpoint_dir``),
written by orbax (async, keep-last-N).
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from ls_jax.rundir import CHECKPOINT_SUBDIR, RunDir


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing, empty or unreadable."""


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` with the run's save policy.

    ``run``: the run directory (a ``RunDir`` or its path); checkpoints go to its
    ``checkpoint_dir``.
    """

    def __init__(self, run: RunDir | str, *, keep: int = 3, async_save: bool = True,
                 create: bool = True):
        run = run if isinstance(run, RunDir) else RunDir(run)
        self.directory = run.checkpoint_dir
        if not create and not os.path.isdir(self.directory):
            raise CheckpointError(
                f"checkpoint: expected a run directory holding '{CHECKPOINT_SUBDIR}/', but "
                f"{self.directory} does not exist")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=create, enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, data_iterator: Any | None = None) -> None:
        items = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            import grain
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int | None, abstract_state: Any, data_iterator: Any | None = None,
                *, partial: bool = False):
        """Restores ``state`` (and the iterator in place) at ``step`` (None: the latest).

        partial: ``abstract_state`` names a part of the saved state (a subset of its keys); only
        that part is read from disk.
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
        if partial:
            items = {"state": ocp.args.PyTreeRestore(
                item=abstract_state, partial_restore=True,
                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))}
        else:
            items = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iterator is not None:
            import grain
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax raises many types for damaged directories
            raise CheckpointError(
                f"checkpoint: step {step} in {self.directory} could not be restored (truncated or "
                f"damaged?): {type(e).__name__}: {e}") from e
        return step, restored["state"]

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
