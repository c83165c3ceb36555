"""Stand-in attention backends for the dispatch tests: the reference backend with its output
scaled by a factor per backend, so that a result shows which backend produced it; every trace
of one is logged by name."""

from ls_jax.kernels.reference import reference_backend


def scaled_reference(name: str, factor: float, log: list):
    """A backend function: the reference's output times ``factor``; appends ``name`` to
    ``log`` each time it runs (is traced)."""

    def backend(q, k, v, **kw):
        log.append(name)
        out, stats = reference_backend(q, k, v, **kw)
        return out * factor, stats

    return backend


def scaled_get_backend(factors: dict, log: list):
    """A stand-in for ``kernels.backends.get_backend``: implementation name -> its scaled reference."""
    return lambda implementation: scaled_reference(implementation, factors[implementation], log)
