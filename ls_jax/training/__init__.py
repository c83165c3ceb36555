"""Training: ``loss``, ``optimizer``, ``state`` (model + optimizer state), ``step`` (the
train step), ``train`` (the loop), ``evaluate``; the run directory (``rundir``,
``checkpoint``, ``metrics``, ``profiler``); ``gc_pause``; ``compile_only`` (a TPU compile
without a TPU)."""
