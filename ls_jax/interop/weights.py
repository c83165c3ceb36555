"""Parameters as safetensors files: of any NNX module (or Linen parameter tree) holding our
layers, and of a trained model's run directory.

    from ls_jax.interop.weights import load_params, save_params
    save_params(my_model, "my_model.safetensors")   # any nnx.Module: its nnx.Param values
    load_params(my_model, "my_model.safetensors")   # into a module of the same structure

    from ls_jax.interop.weights import load_weights, save_weights
    save_weights("runs/tiny", "tiny.safetensors")        # the latest checkpoint's parameters
    model, cfg, step = load_weights("tiny.safetensors")  # a Transformer, ready to call

The file holds one tensor per parameter, named by its path in the model, joined with dots
(``embed.embedding``, ``blocks.0.attn.q_proj.kernel``, ``blocks.0.ln1.scale``,
``ln_f.scale``, ...): the attribute names of the module (for ``ls_jax.layers.transformer.Transformer``, the
keys of ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``; for a Linen tree, its dict keys), so
they change only when the model's code does. Kernels are stored as the model holds them
([in, out]; e.g. ``q_proj.kernel`` is [d_model, n_head * head_dim]), in the parameters'
dtype. The metadata of a run's file carries its config (JSON; its ``model`` section rebuilds
the model) and the checkpoint step. Any safetensors reader takes the file
(``safetensors.numpy.load_file``, ``torch``'s loader). ``save_params``/``load_params`` need
the safetensors package (the [weights] extra); ``save_weights``/``load_weights`` the [train]
extra (orbax reads the checkpoint).
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

__all__ = ["load_params", "load_weights", "parameters", "save_params", "save_weights"]

FORMAT = "ls-jax-weights-1"
PARAMS_FORMAT = "ls-jax-params-1"


def _named_leaves(model) -> list:
    """[(name, array)]: an ``nnx.Module``'s ``nnx.Param`` values, or a nested dict's leaves;
    ValueError (one line) for anything else."""
    import jax
    from flax import nnx

    if isinstance(model, nnx.Module):
        flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
        return [(".".join(map(str, path)), var.get_value()) for path, var in flat]
    if not isinstance(model, dict):
        raise ValueError(f"model: expected an nnx.Module or a nested dict of arrays (a Linen "
                         f"params tree), got {type(model).__name__}")
    return [(".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]]


def parameters(model) -> dict[str, np.ndarray]:
    """name -> numpy array of every parameter of ``model`` (an ``nnx.Module``, or a nested
    dict of arrays such as a Linen ``params`` tree); names: this module's docstring."""
    return {name: np.asarray(value) for name, value in _named_leaves(model)}


def _safetensors():
    try:
        import safetensors.numpy
    except ImportError as e:
        raise ModuleNotFoundError(
            "safetensors: needed to read and write weights files; pip install "
            "'ls-jax[weights]'") from e
    return safetensors.numpy


def _write(tensors: dict, path: str, metadata: dict) -> None:
    """``tensors`` as the safetensors file ``path``, replaced whole (a failed write leaves no
    partial file)."""
    save_file = _safetensors().save_file
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".weights-", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save_params(model, path: str, metadata: dict[str, str] | None = None) -> list[str]:
    """Writes the parameters of ``model`` (an ``nnx.Module`` holding ``LSAttention`` layers and
    any others, or a Linen ``params`` tree) to the safetensors file ``path``, one tensor per
    parameter named by its path, in its dtype (sharded parameters are gathered to this
    host). ``metadata``: str -> str, kept in the file. Returns the names, sorted."""
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"metadata: expected a dict of str to str, got {metadata!r}")
    tensors = parameters(model)
    _write(tensors, path, {**metadata, "format": PARAMS_FORMAT})
    return sorted(tensors)


def load_params(model, path: str):
    """The parameters of the safetensors file ``path`` put into ``model``: an ``nnx.Module`` is
    updated in place (each parameter keeps its sharding) and returned; for a nested dict a new
    dict is returned. Every name, shape and dtype must match (ValueError, one line, naming
    what does not): a file from ``save_params`` of a model of the same structure, or any
    safetensors file with the same names."""
    import jax
    from flax import nnx

    tensors = _safetensors().load_file(path)
    leaves = _named_leaves(model)
    names = {name for name, _ in leaves}
    if names != set(tensors):
        missing, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
        raise ValueError(
            f"weights: {path} does not fit the model: missing {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
            f"{' ...' if len(extra) > 3 else ''}")
    values = {}
    for name, want in leaves:
        value = tensors[name]
        if tuple(value.shape) != tuple(want.shape) or value.dtype != want.dtype:
            raise ValueError(
                f"weights: {name}: expected {np.dtype(want.dtype)}{list(want.shape)}, got "
                f"{value.dtype}{list(value.shape)} in {path}")
        sharding = getattr(want, "sharding", None)
        values[name] = jax.device_put(value, sharding) if sharding is not None else value
    if not isinstance(model, nnx.Module):
        treedef = jax.tree_util.tree_structure(model)
        return jax.tree_util.tree_unflatten(treedef, [values[name] for name, _ in leaves])
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for p, var in flat:
        var.set_value(values[".".join(map(str, p))])
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def save_weights(workdir: str, path: str, step: int | None = None) -> int:
    """Writes the parameters of checkpoint ``step`` (None: the latest) of the run in
    ``workdir`` to the safetensors file ``path`` (replaced whole: a failed write leaves no
    partial file); returns the step."""
    from ls_jax.inference.sample import load_model

    model, cfg, step = load_model(workdir, step)
    _write(parameters(model), path,
           {"format": FORMAT, "config": cfg.to_json(), "step": str(step)})
    return step


def load_weights(path: str):
    """(model, Config, step) from a file written by ``save_weights``: a ``Transformer`` built
    from the file's config with the file's parameters. ValueError (one line) for a file that
    is not such a file or does not fit the model."""
    from flax import nnx
    from safetensors import safe_open

    from ls_jax.config import Config
    from ls_jax.layers.transformer import Transformer

    _safetensors()
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"weights: expected a file written by ls_jax.interop.weights.save_weights (metadata format "
            f"{FORMAT!r}), got {path} with format {metadata.get('format')!r}")
    cfg = Config.from_dict(json.loads(metadata["config"]))
    model = Transformer(cfg.model, rngs=nnx.Rngs(params=0))
    try:
        load_params(model, path)
    except ValueError as e:
        raise ValueError(str(e).replace("does not fit the model",
                                        "does not fit the model of its config")) from None
    return model, cfg, int(metadata["step"])
