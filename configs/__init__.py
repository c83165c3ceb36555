"""Named, typed run configurations: ``get_config("tiny")``, ``get_config("paper", ["train.lr=1e-3"])``."""

from __future__ import annotations

import difflib
from typing import Callable

from ls_jax.config import Config

from ls_jax.configs import paper, tiny

CONFIGS: dict[str, Callable[[], Config]] = {
    "tiny": tiny.tiny,
    "tiny_mhsa": tiny.tiny_mhsa,
    "paper": paper.paper,
    "paper_mhsa": paper.paper_mhsa,
    "paper_qknorm": paper.paper_qknorm,
    "paper_zloss": paper.paper_zloss,
}


def get_config(name: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config called ``name`` with ``section.key=value`` overrides applied."""
    if name not in CONFIGS:
        close = difflib.get_close_matches(name, list(CONFIGS), n=2)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(f"config: expected one of {sorted(CONFIGS)}, got {name!r}{hint}")
    return CONFIGS[name]().override(list(overrides))


__all__ = ["CONFIGS", "get_config"]
