"""Python's cyclic garbage collector paused around start-up work: imports and tracing make
millions of objects but almost no reference cycles, so a collection there only walks live
objects (and holds the GIL that tracing threads need)."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collection_paused(*, freeze: bool = False) -> Iterator[None]:
    """No collection inside the block; the collector is left as it was found, also when the
    block raises. freeze: then move every object alive at its end out of later collections'
    view (``gc.freeze``), for objects that live as long as the process (imported modules)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if collecting:
            gc.enable()
