"""Experiments built on the library, run from the repository root (`python -m experiments.stability`)."""

import argparse
import os


def results_dir(path: str) -> str:
    """``--out`` of an experiment (an argparse type): a folder of results, new or an earlier
    run's to resume; an existing file is refused in one line, before anything runs."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(
            f"{path} is a file; expected a results folder (a new one, or an earlier run's to "
            "resume)")
    return path
