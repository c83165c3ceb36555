"""Evaluate a run: ``python eval.py --checkpoint DIR [--split validation] [--seq-len T] [--max-batches K]``."""

import sys

if __name__ == "__main__":
    try:
        from ls_jax.configs.cli import eval_main
    except ModuleNotFoundError as e:  # a Python without the project's packages (not the venv)
        from ls_jax.run_hint import how_to_run
        sys.exit(how_to_run(e, [sys.argv[0], *sys.argv[1:]], "eval", "evaluation"))
    sys.exit(eval_main())
