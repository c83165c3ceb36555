"""Evaluate a run: ``python eval.py --checkpoint DIR [--split validation] [--seq-len T] [--max-batches K]``."""

import sys

from ls_jax.configs.cli import eval_main

if __name__ == "__main__":
    sys.exit(eval_main())
