"""The rules that judge a training run's losses, applied by every experiment and by the
stability page (``experiments.stability_report``): a spike, and divergence.

- **Spike:** a logged loss > ``SPIKE_FACTOR`` x the median of the ``SPIKE_WINDOW`` logged
  losses before it (or a non-finite loss).
- **Diverged:** a non-finite loss, or the median of the last ``TAIL_FRACTION`` of the losses
  is > ``BLOWUP_FACTOR`` x the best ``RUNNING``-loss running median. Applied to every prefix
  of a run (``divergence``) it also tells from which step the rule holds.

The functions take the logged losses in order (every step, or every n-th: the rule reads
whatever was logged) and need nothing but numpy, so the page can apply them to stored results.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

SPIKE_FACTOR = 1.5  # a jump to 1.5x the recent median is far outside a smooth run's noise
SPIKE_WINDOW = 50  # losses in that median: long enough to ignore one noisy neighbour
BLOWUP_FACTOR = 1.5  # a run whose recent median is 1.5x its best has lost its progress
TAIL_FRACTION = 0.05  # the "recent" part of a run: its last 5% of logged losses
RUNNING = 11  # losses in the running median whose minimum is the run's best


def _trailing_medians(x: np.ndarray, window: int) -> np.ndarray:
    """m[i] = median(x[max(0, i - window + 1) .. i])."""
    out = np.empty(len(x))
    head = min(window - 1, len(x))
    for i in range(head):
        out[i] = np.median(x[:i + 1])
    if len(x) >= window:
        out[window - 1:] = np.median(sliding_window_view(x, window), axis=1)
    return out


def spike_ratios(losses) -> np.ndarray:
    """ratio[i - 1] = losses[i] / median(the ``SPIKE_WINDOW`` losses before i), for i >= 1;
    inf where the loss is not finite."""
    x = np.asarray(losses, np.float64)
    if len(x) < 2:
        return np.empty(0)
    before = _trailing_medians(x, SPIKE_WINDOW)[:-1]  # the window ending at i - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = x[1:] / before
    return np.where(np.isfinite(x[1:]), ratios, math.inf)


def count_spikes(losses, factor: float = SPIKE_FACTOR) -> int:
    """Logged losses more than ``factor`` x the median of the ``SPIKE_WINDOW`` before them."""
    return int(np.sum(spike_ratios(losses) > factor))


def running_best(losses) -> np.ndarray:
    """best[i] = the lowest ``RUNNING``-loss running median of losses[0..i]."""
    x = np.asarray(losses, np.float64)
    return np.minimum.accumulate(_trailing_medians(x, RUNNING)) if len(x) else x


def tail_size(n: int) -> int:
    """How many of a run's ``n`` logged losses are its tail."""
    return max(1, int(n * TAIL_FRACTION))


def tail_ratio(losses) -> float:
    """The median of the last ``TAIL_FRACTION`` of ``losses`` over their best running median."""
    x = np.asarray(losses, np.float64)
    return float(np.median(x[-tail_size(len(x)):])) / float(running_best(x)[-1])


def blew_up(losses, factor: float = BLOWUP_FACTOR) -> bool:
    """The divergence rule on a whole run: a non-finite loss, or ``tail_ratio`` > ``factor``."""
    x = np.asarray(losses, np.float64)
    if not len(x) or not np.all(np.isfinite(x)):
        return True
    return tail_ratio(x) > factor


def prefix_tail_ratios(losses) -> np.ndarray:
    """r[n - 1] = ``tail_ratio(losses[:n])`` for every n (the losses finite)."""
    x = np.asarray(losses, np.float64)
    best = running_best(x)
    tails = np.empty(len(x))
    n = 1
    while n <= len(x):  # n with the same tail size share one vectorised median
        w = tail_size(n)
        last = n
        while last + 1 <= len(x) and tail_size(last + 1) == w:
            last += 1
        windows = sliding_window_view(x[:last], w)[n - w:last - w + 1]
        tails[n - 1:last] = np.median(windows, axis=1)
        n = last + 1
    return tails / best


def divergence(losses, factor: float = BLOWUP_FACTOR) -> dict:
    """The divergence rule applied to the losses up to every logged index n (1-based): the
    ratio at the end (``end_ratio``), the largest ratio (``max_ratio`` at ``max_at``), and the
    runs of consecutive n at which the rule holds (``held``: [first, last] pairs; from the
    first non-finite loss on it holds to the end)."""
    x = np.asarray(losses, np.float64)
    finite = np.isfinite(x)
    stop = len(x) if finite.all() else int(np.argmin(finite))
    ratios = prefix_tail_ratios(x[:stop])
    held: list[list[int]] = []
    for n in (np.nonzero(ratios > factor)[0] + 1).tolist():
        if held and n == held[-1][1] + 1:
            held[-1][1] = n
        else:
            held.append([n, n])
    if stop < len(x):
        if held and held[-1][1] == stop:
            held[-1][1] = len(x)
        else:
            held.append([stop + 1, len(x)])
    k = int(np.argmax(ratios)) if len(ratios) else None
    return {"end_ratio": float(ratios[-1]) if stop == len(x) and len(ratios) else math.inf,
            "max_ratio": math.nan if k is None else float(ratios[k]),
            "max_at": None if k is None else k + 1, "held": held,
            "non_finite_at": None if stop == len(x) else stop + 1}
