"""Training: ``loss``, ``optimizer``, ``state`` (model + optimizer state), ``step`` (the
train step), ``train`` (the loop), ``stopping`` (signals, step and time limits),
``evaluate``; the run directory (``rundir``, ``checkpoint``, ``metrics``, ``profiler``);
``gc_pause``; ``compile_only`` (a TPU compile without a TPU)."""
