"""The one line an entry point prints when the Python running it lacks the project's packages.

``python3 train.py`` with a system Python (no JAX, no installed ``ls_jax``) finds this checkout's
``ls_jax`` folder beside the script, but not JAX or ``ls_jax.configs``; instead of a traceback it
gets one line saying how to run the command. This module imports only the standard library and
keeps to syntax that older Pythons parse, since it runs under whatever Python the user typed.
"""

from __future__ import annotations

import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv")


def in_checkout() -> bool:
    """Whether this ``ls_jax`` is a source checkout's (its Makefile beside it), not a wheel's."""
    return all(os.path.isfile(os.path.join(ROOT, f)) for f in ("Makefile", "pyproject.toml"))


def how_to_run(error: ModuleNotFoundError, command: list[str], make_target: str,
               what: str) -> str:
    """One ``error:`` line for ``command`` (as typed after ``python``: ``["train.py", ...]`` or
    ``["-m", "ls_jax.inference.sample", ...]``), whose imports failed with ``error``; ``what`` names the
    work for an installed package without the [train] extra (``"sampling"``)."""
    missing = error.name or str(error)
    if not in_checkout():
        return (f"error: {what} needs the [train] extra (missing module {missing!r}): "
                f"pip install 'ls-jax[train]'")
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return (f"error: the project's venv has no module {missing!r}: make it again "
                f"(rm -rf .venv; make venv)")
    venv_python = _shortest(os.path.join(VENV, "bin", "python"))
    rerun = f"{venv_python} {shlex.join(command)}"
    root = _shortest(ROOT)
    make = f"make {make_target}" if root == "." else f"make -C {root} {make_target}"
    if os.path.exists(os.path.join(VENV, "bin", "python")):
        how = f"{rerun} (or {make})"
    else:
        how = f"{make} (it makes .venv first), or after make venv: {rerun}"
    name = command[1] if command[0] == "-m" else os.path.basename(command[0])
    return (f"error: {name} runs in the project's venv ({sys.executable} has no module "
            f"{missing!r}): {how}")


def _shortest(path: str) -> str:
    """``path`` relative to the working directory when below it, else absolute."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel
