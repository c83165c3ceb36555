"""Train an LS-attention LM: ``python train.py --config tiny [--workdir DIR] [key=value ...]``."""

import sys

from ls_jax.configs.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
