"""Peak numbers of the cards the benchmarks run on (vendor data sheets, SXM parts), by jax's
``device_kind``: dense bf16 FLOP/s and HBM bytes/s. Used for MFU and % of the floor."""

from __future__ import annotations

# name fragment of device_kind -> (dense bf16 FLOP/s, HBM bytes/s)
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "A100": (312e12, 2.0e12),
         "B200": (2250e12, 8.0e12)}


def peaks(device_kind: str) -> tuple[float, float] | None:
    """(FLOP/s, bytes/s) of the card, or None for one not in the table (e.g. CPU)."""
    for name, peak in PEAKS.items():
        if name in device_kind:
            return peak
    return None
