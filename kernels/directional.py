"""One backend for a call that nothing differentiates, another for one that is differentiated.

``jax.custom_vjp`` runs its primal function when no transformation differentiates the call
(inference, evaluation, a generation prefill) and its ``fwd``/``bwd`` pair under ``jax.grad``,
``jax.vjp`` or ``jax.value_and_grad``. ``directional_backend`` uses that to give one call site
the fastest forward and the fastest forward+backward when they are different backends: the
"differentiated" backend's own forward saves the residuals its own backward needs (through
``jax.vjp``), so a gradient never mixes the two backends. The two forwards agree to the
backends' accuracy, not bit for bit: ``f(x)`` and ``jax.value_and_grad(f)(x)[0]`` may differ
in the last bits. Pass ``implementation=`` to ``ls_attention`` to run one backend everywhere.

Which pairs ``implementation=None`` uses: ``kernels/dispatch.py`` (``choose_implementation``
for differentiated calls, ``choose_primal_implementation`` for the rest).
"""

from __future__ import annotations

import jax


def directional_backend(primal_backend, differentiated_backend):
    """A backend function (the signature of ``kernels.api``'s backends) that runs
    ``primal_backend`` when the call is not differentiated and ``differentiated_backend``
    (forward and backward) when it is. Calls with logit statistics or segment ids run
    ``differentiated_backend`` alone (dispatch never pairs backends for those)."""

    def backend(q, k, v, *, window_sizes, segment_ids, scale, return_logit_stats, interpret):
        options = dict(window_sizes=window_sizes, segment_ids=segment_ids, scale=scale,
                       return_logit_stats=return_logit_stats, interpret=interpret)
        if return_logit_stats or segment_ids is not None:
            return differentiated_backend(q, k, v, **options)

        def output(fn, q, k, v):
            return fn(q, k, v, **options)[0]

        @jax.custom_vjp
        def attend(q, k, v):
            return output(primal_backend, q, k, v)

        def attend_fwd(q, k, v):
            return jax.vjp(lambda *qkv: output(differentiated_backend, *qkv), q, k, v)

        def attend_bwd(pullback, do):
            return pullback(do)

        attend.defvjp(attend_fwd, attend_bwd)
        return attend(q, k, v), None

    return backend
