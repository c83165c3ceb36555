"""``train.profile_steps=a:b``: a JAX profiler trace of training steps a..b.

The trace goes into the run's TensorBoard directory (``<logdir>/plugins/profile/<time>/``,
``*.xplane.pb``), where TensorBoard's profile plugin and XProf find it next to the scalars.
"""

from __future__ import annotations

from typing import Any, Callable

import jax


class StepProfiler:
    """Starts a trace before step ``first`` runs and stops it once step ``last`` has finished.

    Steps are 1-based, as logged. A run resumed inside the window traces the window's remaining
    steps; one resumed past it traces nothing. ``close`` ends an unfinished trace (early stop).
    """

    def __init__(self, step_range: tuple[int, int] | None, log_dir: str,
                 log: Callable[[str], None] = print):
        self.range, self.log_dir, self.log = step_range, log_dir, log
        self.active = False

    def before_step(self, step: int) -> None:
        """Call with the number of the step about to run."""
        if self.range is None or self.active:
            return
        first, last = self.range
        if first <= step <= last:
            jax.profiler.start_trace(self.log_dir)
            self.active = True
            self.log(f"profiling steps {step}..{last} into {self.log_dir}")

    def after_step(self, step: int, outputs: Any) -> None:
        """Call with the number of the step just launched and its outputs (waited for)."""
        if self.active and step >= self.range[1]:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
