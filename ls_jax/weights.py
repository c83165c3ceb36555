"""A trained model's parameters out of a run directory as safetensors, and back into a model.

    from ls_jax.weights import load_weights, save_weights
    save_weights("runs/tiny", "tiny.safetensors")        # the latest checkpoint's parameters
    model, cfg, step = load_weights("tiny.safetensors")  # a Transformer, ready to call

The file holds one tensor per parameter, named by its path in the model, joined with dots
(``embed.embedding``, ``blocks.0.attn.q_proj.kernel``, ``blocks.0.ln1.scale``,
``ln_f.scale``, ...): the attribute names of ``ls_jax.model.Transformer``, the keys of
``nnx.to_pure_dict(nnx.state(model, nnx.Param))``, so they change only when the model's code
does. Kernels are stored as the model holds them ([in, out]; e.g. ``q_proj.kernel`` is
[d_model, n_head * head_dim]), in the parameters' dtype. The file's metadata carries the run's
config (JSON; its ``model`` section rebuilds the model) and the checkpoint step. Any
safetensors reader takes the file (``safetensors.numpy.load_file``, ``torch``'s loader).
Needs the [train] extra (orbax reads the checkpoint; safetensors writes the file).
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

__all__ = ["load_weights", "parameters", "save_weights"]

FORMAT = "ls-jax-weights-1"


def parameters(model) -> dict[str, np.ndarray]:
    """name -> numpy array of every parameter of ``model`` (names: this module's docstring)."""
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


def save_weights(workdir: str, path: str, step: int | None = None) -> int:
    """Writes the parameters of checkpoint ``step`` (None: the latest) of the run in
    ``workdir`` to the safetensors file ``path`` (replaced whole: a failed write leaves no
    partial file); returns the step."""
    from safetensors.numpy import save_file

    from ls_jax.sample import load_model

    model, cfg, step = load_model(workdir, step)
    tensors = parameters(model)
    metadata = {"format": FORMAT, "config": cfg.to_json(), "step": str(step)}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".weights-", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return step


def load_weights(path: str):
    """(model, Config, step) from a file written by ``save_weights``: a ``Transformer`` built
    from the file's config with the file's parameters. ValueError (one line) for a file that
    is not such a file or does not fit the model."""
    from flax import nnx
    from safetensors import safe_open
    from safetensors.numpy import load_file

    from ls_jax.config import Config
    from ls_jax.model import Transformer

    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"weights: expected a file written by ls_jax.weights.save_weights (metadata format "
            f"{FORMAT!r}), got {path} with format {metadata.get('format')!r}")
    cfg = Config.from_dict(json.loads(metadata["config"]))
    tensors = load_file(path)
    model = Transformer(cfg.model, rngs=nnx.Rngs(params=0))
    params = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(params)
    names = {".".join(map(str, p)) for p, _ in flat}
    if names != set(tensors):
        missing, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
        raise ValueError(
            f"weights: {path} does not fit the model of its config: missing {missing[:3]}, "
            f"unexpected {extra[:3]}")
    for p, var in flat:
        name = ".".join(map(str, p))
        value = tensors[name]
        want = var.get_value()
        if value.shape != want.shape or value.dtype != want.dtype:
            raise ValueError(
                f"weights: {name}: expected {want.dtype}{list(want.shape)}, got "
                f"{value.dtype}{list(value.shape)} in {path}")
        var.set_value(value)
    nnx.update(model, nnx.from_flat_state(flat))
    return model, cfg, int(metadata["step"])
