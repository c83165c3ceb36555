"""Train an LS-attention LM: ``python train.py --config tiny [--workdir DIR] [key=value ...]``."""

import os
import signal
import sys


def _stop_outside_the_run(signum, frame):
    """SIGTERM / Ctrl-C while importing or exiting, outside ``ls_jax.training.train.train`` (whose own
    handlers save what a stop would lose): nothing is in progress, so stop at once, one line."""
    print(f"stopped ({signal.Signals(signum).name}) outside the training loop: nothing to save; "
          f"rerun the same command to resume", flush=True)
    os._exit(0)


if __name__ == "__main__":
    for _sig in (signal.SIGTERM, signal.SIGINT):  # before the imports, which take seconds
        signal.signal(_sig, _stop_outside_the_run)
    try:
        from ls_jax.configs.cli import train_main
    except ModuleNotFoundError as e:  # a Python without the project's packages (not the venv)
        from ls_jax.run_hint import how_to_run
        sys.exit(how_to_run(e, [sys.argv[0], *sys.argv[1:]], "train", "training"))
    sys.exit(train_main())
