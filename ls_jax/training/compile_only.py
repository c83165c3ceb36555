"""Compile a run's steps for a TPU slice without a TPU: does a config fit, before renting it?

``python train.py --config paper --compile-only v5e:2x4 [section.key=value ...]`` builds the
train step of ``ls_jax/training/step.py`` (``compile_train_fns``: the model, optimizer, shardings and
donation of a real run) and the evaluation step of ``ls_jax/training/evaluate.py`` on the mesh the
config asks for, over the devices of a TPU topology description (libtpu, the ``jax[tpu]``
extra, compiles for v4/v5e/v5p/v6e topologies on any host), and compiles them with the TPU
compiler, Mosaic kernels included. It reads no data and writes nothing. The report gives, per
device (one device is one chip on v5e, v5p and v6e): the parameter and optimizer-state bytes,
each program's arguments, temporaries and total against the device's HBM, the FLOPs of one
execution from XLA's cost analysis (the attention kernels' from their work lists), and the
attention kernel calls in each program. ``--compile-only local`` does the same for this
host's own devices on its own backend (CPU, GPU or TPU).

A program that does not fit is refused by the compiler (out of HBM, or a kernel out of
VMEM); the report quotes its message.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ls_jax import sharding as sharding_lib
from ls_jax.config import Config
from ls_jax.kernels.dispatch import choose_implementation
from ls_jax.kernels.sharded import qkv_gathers

LOCAL = "local"

# HBM per device (GiB; Google Cloud's per-chip figures, one device per chip on these kinds).
# A kind not listed (v4, whose compile-only topologies list each TensorCore as a device) is
# reported without a capacity; its compiler still refuses a program that does not fit.
HBM_GIB_BY_DEVICE_KIND = {"TPU v5 lite": 16, "TPU v5": 95, "TPU v6 lite": 32}

# custom calls that are attention kernels: Mosaic TPU, Triton, Mosaic GPU
_KERNEL_CALL = re.compile(r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton|'
                          r'mosaic_gpu[^"]*)"')
_INSTRUCTION_NAME = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+?)(?:\.\d+)*\s*=")

# exit status of a compile-only run whose programs do not all fit (an error exits 1)
EXIT_DOES_NOT_FIT = 3


def prepare_libtpu() -> None:
    """On a host without TPU chips, sets libtpu up for compiling only; call it before JAX
    initialises its backends. On a host with TPU chips it changes nothing.

    * Off a TPU VM, libtpu cannot learn its slice from the metadata server (JAX skips the
      query) and prints that TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES could not be
      determined. Saying that this host is a slice of one host
      (``TPU_WORKER_HOSTNAMES=localhost``, ``TPU_HOST_BOUNDS=1,1,1``) is true and silences
      them; a topology description's layout does not depend on them.
    * libtpu's lock file keeps a second process from driving the same TPU; with no TPU to
      drive, ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` lets compiles run side by side (test workers,
      several compile-only runs).
    """
    if _host_has_tpu_chips():
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _host_has_tpu_chips() -> bool:
    try:  # JAX's own test for attached TPU chips (PCI vendor and device ids)
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except (ImportError, AttributeError):  # moved: change nothing, as on a TPU host
        return True


def topology_devices(topology: str) -> list:
    """The devices to compile for: this host's for ``"local"``, else the compile-only devices
    of the TPU topology ``topology`` (e.g. "v5e:2x4"; needs libtpu). One-line errors."""
    if topology == LOCAL:
        return jax.devices()
    try:
        import libtpu  # noqa: F401  (the jax[tpu] extra)
    except ImportError:
        raise ValueError(
            f"--compile-only: compiling for the TPU topology {topology!r} needs libtpu: "
            f"pip install 'jax[tpu]=={jax.__version__}' (or `make venv-tpu`)") from None
    from jax.experimental import topologies
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except jax.errors.JaxRuntimeError as e:
        reason = " ".join(str(e).split()).removeprefix("INVALID_ARGUMENT: ")
        raise ValueError(
            f"--compile-only: expected a TPU topology such as v5e:2x4, v6e:2x2, v5p:2x2x1 or "
            f"'{LOCAL}', got {topology!r} ({reason})") from None


def compile_mesh(cfg: Config, devices: list) -> jax.sharding.Mesh:
    """The config's (data, fsdp, tensor) mesh over ``devices``, laid out along the physical
    topology (``mesh_utils.create_device_mesh``, as ``jax.make_mesh`` does on a slice)."""
    from jax.experimental import mesh_utils
    shape = sharding_lib.mesh_shape(cfg.mesh, len(devices))
    ordered = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return sharding_lib.make_mesh(cfg.mesh, ordered.reshape(-1))


@dataclasses.dataclass
class Program:
    """One compiled program's figures per device, or the compiler's refusal."""

    name: str
    compile_s: float
    error: str | None = None  # the compiler's message when it refused the program
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs written into donated arguments
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float | None = None
    kernel_calls: dict[str, int] = dataclasses.field(default_factory=dict)  # by call name
    # all-gathers whose result has the shape of q, k or v (``kernels.sharded.qkv_gathers``):
    # none when the kernel runs per shard; any other array of that shape counts too (the
    # embeddings' [B, T, d_model] where d_model = heads x head_dim)
    qkv_gathers: int = 0

    @property
    def total_bytes(self) -> int:
        """What the program holds at once: arguments, outputs not written over a donated
        argument, temporaries and code."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes)


@dataclasses.dataclass
class Report:
    config: str
    topology: str
    device_kind: str
    num_devices: int
    mesh: dict[str, int]
    attention: str
    batch_size: int
    batch_per_device: int
    seq_len: int
    grad_accum_steps: int
    model_bytes: int  # per device: the parameters
    optimizer_bytes: int  # per device: the optimizer's moments and step
    hbm_bytes: int | None  # per device; None: unknown for this device kind
    programs: list[Program]

    @property
    def fits(self) -> bool:
        """Every program compiled, and (where the HBM is known) holds at most all of it."""
        return all(p.error is None and (self.hbm_bytes is None or p.total_bytes <= self.hbm_bytes)
                   for p in self.programs)


def _bytes_per_device(tree) -> int:
    """Bytes of one device's shards of a tree of ShapeDtypeStructs with shardings."""
    return sum(jnp.dtype(x.dtype).itemsize * math.prod(x.sharding.shard_shape(x.shape))
               for x in jax.tree.leaves(tree))


def kernel_calls(hlo_text: str) -> dict[str, int]:
    """{instruction name without its numeric suffix: count} of the attention kernel calls in
    compiled HLO text (``ls_attention_tpu_fwd`` etc. for the TPU kernels)."""
    calls: dict[str, int] = {}
    for line in hlo_text.splitlines():
        if "custom_call_target" in line and _KERNEL_CALL.search(line):
            match = _INSTRUCTION_NAME.match(line)
            name = match.group(1) if match else "custom-call"
            calls[name] = calls.get(name, 0) + 1
    return calls


def _compile(name: str, lower: Callable[[], Any], cfg: Config) -> Program:
    t0 = time.perf_counter()
    try:
        compiled = lower().compile()
    except jax.errors.JaxRuntimeError as e:
        text = " ".join(str(e).split())
        if not text.startswith("RESOURCE_EXHAUSTED"):
            raise
        return Program(name, time.perf_counter() - t0, error=text.split(" HLO module:")[0])
    seconds = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # one entry per partition on some JAX versions
        cost = cost[0] if cost else {}
    hlo = compiled.as_text()
    m = cfg.model
    return Program(
        name, seconds, argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes, code_bytes=memory.generated_code_size_in_bytes,
        flops=(cost or {}).get("flops"), kernel_calls=kernel_calls(hlo),
        qkv_gathers=len(qkv_gathers(hlo, cfg.data.seq_len, m.n_head, m.head_dim)))


PROGRAMS = ("train step", "train step + statistics", "eval step")


def compile_steps(cfg: Config, topology: str, *, programs: tuple[str, ...] = PROGRAMS,
                  log: Callable[[str], None] | None = None) -> Report:
    """Compiles ``programs`` of ``cfg`` for ``topology`` (a TPU topology name or ``"local"``);
    nothing runs. The train step is what most steps run, "+ statistics" the logged steps'
    variant with the logit statistics, "eval step" the evaluation's. ValueError (one line)
    for a bad topology, program name or batch split."""
    from ls_jax.training.evaluate import _eval_fn  # the [train] extra's packages, imported when used
    from ls_jax.training.state import MODEL_KEY
    from ls_jax.training.step import check_batch_split, compile_train_fns

    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown or not programs:
        raise ValueError(f"programs: expected a non-empty subset of {PROGRAMS}, got {programs}")
    devices = topology_devices(topology)
    if cfg.model.attn_implementation is None:  # what a run on that platform would choose
        implementation = choose_implementation(devices[0].platform)
        cfg = cfg.override([f"model.attn_implementation={implementation}"])
    mesh = compile_mesh(cfg, devices)
    check_batch_split(cfg.train, mesh)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    compiled = []
    with jax.set_mesh(mesh):
        fns = compile_train_fns(cfg, mesh)
        state, batch = fns.step_args
        lowerings = {
            "train step": lambda: fns.steps[False].lower(state, batch),
            "train step + statistics": lambda: fns.steps[True].lower(state, batch),
            "eval step": lambda: _lower_eval_step(_eval_fn, cfg, mesh, batch),
        }
        for name in programs:
            if log:
                log(f"compiling the {name} for {topology} ...")
            compiled.append(_compile(name, lowerings[name], cfg))
    hbm_gib = HBM_GIB_BY_DEVICE_KIND.get(devices[0].device_kind)
    model_bytes = _bytes_per_device(state[MODEL_KEY])
    return Report(
        config=cfg.name, topology=topology, device_kind=devices[0].device_kind,
        num_devices=len(devices), mesh=dict(mesh.shape), attention=cfg.model.attn_implementation,
        batch_size=B, batch_per_device=B // sharding_lib.batch_divisor(mesh), seq_len=T,
        grad_accum_steps=cfg.train.grad_accum_steps, model_bytes=model_bytes,
        optimizer_bytes=_bytes_per_device(state) - model_bytes,
        hbm_bytes=None if hbm_gib is None else hbm_gib * 2**30, programs=compiled)


def _lower_eval_step(eval_fn, cfg: Config, mesh, batch):
    """The evaluation step (``ls_jax.training.evaluate``) lowered for the model alone, with the run's
    parameter shardings, on a training batch."""
    from flax import nnx

    from ls_jax.layers.transformer import Transformer

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        graphdef, abstract = nnx.split(nnx.eval_shape(
            lambda: Transformer(cfg.model, rngs=nnx.Rngs(params=cfg.train.seed))))
    state = sharding_lib.with_shardings(abstract, sharding_lib.state_shardings(abstract, mesh))
    byte_lengths = jax.ShapeDtypeStruct((cfg.model.vocab_size,), jnp.int32,
                                        sharding=sharding_lib.replicated(mesh))
    return eval_fn(graphdef).lower(state, batch, byte_lengths)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _flops(x: float | None) -> str:
    if x is None:
        return "?"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} FLOP"


def format_report(r: Report) -> str:
    """The report as printed: a header, one row per program, and the verdict."""
    hbm = _size(r.hbm_bytes) if r.hbm_bytes is not None else "unknown"
    mesh = " ".join(f"{k}={v}" for k, v in r.mesh.items())
    accum = f" in {r.grad_accum_steps} micro-batches" if r.grad_accum_steps > 1 else ""
    lines = [
        f"{r.config} for {r.topology}: {r.num_devices} x {r.device_kind}, HBM {hbm} each; "
        f"mesh {mesh}; attention {r.attention}",
        f"batch {r.batch_size} x {r.seq_len} tokens: {r.batch_per_device} sequences per "
        f"device{accum}",
        f"per device: parameters {_size(r.model_bytes)}, optimizer state "
        f"{_size(r.optimizer_bytes)}",
    ]
    rows = [("program", "total", "of HBM", "arguments", "temporaries", "code", "FLOPs",
             "attention kernel calls", "compile")]
    for p in r.programs:
        if p.error is not None:
            rows.append((p.name, "does not fit", "", "", "", "", "", "", f"{p.compile_s:.0f} s"))
            continue
        share = f"{100 * p.total_bytes / r.hbm_bytes:.0f}%" if r.hbm_bytes else "?"
        calls = ", ".join(f"{k.removeprefix('ls_attention_tpu_')} {v}"
                          for k, v in sorted(p.kernel_calls.items()))
        rows.append((p.name, _size(p.total_bytes), share, _size(p.argument_bytes),
                     _size(p.temp_bytes), _size(p.code_bytes), _flops(p.flops), calls or "none",
                     f"{p.compile_s:.0f} s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
              for row in rows]
    lines += [f"  {p.name}: {p.error}" for p in r.programs if p.error is not None]
    if r.fits:
        largest = max(p.total_bytes for p in r.programs)
        lines.append(f"fits: the largest program holds {_size(largest)} per device"
                     + (f" of {hbm}" if r.hbm_bytes is not None else ""))
    else:
        lines.append(f"does not fit {r.topology}")
    return "\n".join(lines)


def compile_only_main(cfg: Config, topology: str) -> int:
    """``train.py --compile-only TOPOLOGY``: prints the report; 0 if it fits, else
    ``EXIT_DOES_NOT_FIT``. Progress lines go to stderr."""
    prepare_libtpu()
    report = compile_steps(cfg, topology, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_report(report))
    return 0 if report.fits else EXIT_DOES_NOT_FIT
