"""Argument parsing and entry functions behind the thin ``train.py`` and ``eval.py`` scripts.

It sits above the library: it resolves named configs (this package) and calls ``ls_jax``.
Importing it and ``--help`` need only the core install; a command that runs needs the [train]
extra, and without it ends with one line naming it.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import types

from ls_jax.config import valid_keys
from ls_jax.configs import CONFIGS, get_config
from ls_jax.training.gc_pause import collection_paused
from ls_jax.training.rundir import RunDir


def _train_extra() -> types.SimpleNamespace:
    """The [train] extra's part of the library, imported when a command runs; without the
    extra (`pip install ls-jax` alone) one line naming it and exit status 1.

    The imports (JAX, Flax, optax, orbax, grain: about a million objects that live as long as
    the process) run with the cyclic garbage collector paused, and are then frozen out of its
    view (``gc.freeze``), so that no collection during start-up walks them again."""
    with collection_paused(freeze=True):
        return _import_train_extra()


def _import_train_extra() -> types.SimpleNamespace:
    try:
        from ls_jax.training.checkpoint import CheckpointError
        from ls_jax.training.evaluate import evaluate_checkpoint
        from ls_jax.training.metrics import send_library_logs_to
        from ls_jax.training.rundir import RunDir, WorkdirLocked
        from ls_jax.sharding import maybe_initialize_distributed
        from ls_jax.training.train import TrainingDiverged, train, use_compilation_cache
    except ModuleNotFoundError as e:
        raise SystemExit(f"error: training and evaluation need the [train] extra (missing "
                         f"module {e.name!r}): pip install 'ls-jax[train]'") from e
    # Errors a user can cause or fix (bad input, a locked or damaged run directory, a full
    # disk, a diverged run): one line on stderr and a non-zero exit; anything else is a bug.
    expected = (ValueError, OSError, ImportError, CheckpointError, WorkdirLocked,
                TrainingDiverged)
    return types.SimpleNamespace(
        expected_errors=expected, evaluate_checkpoint=evaluate_checkpoint, train=train,
        use_compilation_cache=use_compilation_cache,
        maybe_initialize_distributed=maybe_initialize_distributed,
        send_library_logs_to=send_library_logs_to, RunDir=RunDir)


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one ``error:`` line (no usage), exit 2."""

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(message.split())}\n")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"error: {text or type(e).__name__}"


def _train_epilog() -> str:
    """``train.py --help``'s end: every named config with its one-line summary, and every
    override key by section."""
    width = max(len(name) for name in CONFIGS)
    lines = ["named configs (--config NAME):"]
    for name, make in CONFIGS.items():
        summary = (make.__doc__ or "").strip().splitlines()[0].rstrip(".") if make.__doc__ else ""
        lines.append(f"  {name:<{width}}  {summary}")
    lines += ["", "override keys (section.key=value):"]
    keys = valid_keys(get_config("tiny"))
    for section in dict.fromkeys(k.partition(".")[0] for k in keys):
        names = ", ".join(k.partition(".")[2] for k in keys if k.startswith(section + "."))
        lines += textwrap.wrap(names, 96, initial_indent=f"  {section}: ",
                               subsequent_indent=" " * (len(section) + 4))
    lines += ["", "example: python train.py --config tiny --workdir runs/tiny train.num_steps=200"]
    return "\n".join(lines)


def train_parser() -> argparse.ArgumentParser:
    """``train.py``'s command line."""
    parser = _Parser(description="Train an LS-attention language model.",
                     epilog=_train_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny", metavar="NAME",
                        help="named config, listed below (default: %(default)s)")
    parser.add_argument("--workdir", default=None,
                        help="run directory (checkpoints, metrics); default runs/<config>. "
                             "Rerunning the same command resumes from its latest checkpoint.")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() (multi-host TPU/GPU)")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error instead of one line")
    parser.add_argument("--compile-only", metavar="TOPOLOGY", default=None,
                        help="only compile the train and eval steps for a TPU slice (e.g. "
                             "v5e:2x4; needs libtpu) or 'local' (this host's devices) and print "
                             "per-device memory against HBM, FLOPs and kernel calls; reads no "
                             "data, writes nothing (exit 3: does not fit)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides, e.g. train.lr=1e-3 model.window=64")
    return parser


def train_main(argv: list[str] | None = None) -> int:
    parser = train_parser()
    args = parser.parse_args(argv)
    try:
        cfg = get_config(args.config, args.overrides)
    except ValueError as e:
        parser.error(str(e))
    lib = _train_extra()
    if args.compile_only is not None:  # reads no data and writes no workdir
        from ls_jax.training.compile_only import compile_only_main
        try:
            return compile_only_main(cfg, args.compile_only)
        except lib.expected_errors as e:
            if args.debug:
                raise
            print(_one_line(e), file=sys.stderr)
            return 1
    workdir = args.workdir or f"runs/{cfg.name}"
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        parser.error(f"--workdir: {workdir} is a file; expected a run directory (a new one, or "
                     f"an earlier run's to resume)")
    lib.maybe_initialize_distributed(args.distributed)
    try:
        lib.send_library_logs_to(lib.RunDir(workdir).library_log_path, echo=args.debug,
                                 required=True)
        lib.use_compilation_cache()
        # a second signal ends the process from a thread of its own, with its one line
        result = lib.train(cfg, workdir, exit_at_once=True)
    except lib.expected_errors as e:
        if args.debug:
            raise
        print(_one_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # a second signal: stopped at once (ls_jax.training.stopping.Interrupted)
        if args.debug:
            raise
        print(_one_line(e) if str(e) else "error: interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)
    if not result.interrupted:  # a stop logged its own line
        print(f"done: step {result.final_step} in {workdir}")
    return 0


def eval_parser() -> argparse.ArgumentParser:
    """``eval.py``'s command line."""
    parser = _Parser(description="Evaluate a checkpoint written by train.py.")
    parser.add_argument("--checkpoint", required=True, help="the run directory (train --workdir)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--split", default=None, help="data split (default: the config's eval split)")
    parser.add_argument("--seq-len", type=_at_least_one, default=None,
                        help="sequence length (default: training's); may differ, for length generalisation")
    parser.add_argument("--max-batches", type=_at_least_one, default=None,
                        help="read only the first K batches (default: the whole split)")
    parser.add_argument("--batch-size", type=_at_least_one, default=None, help="default: training's")
    parser.add_argument("--output", default=None, help="JSON output path")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error instead of one line")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides that leave the model alone: data.* (e.g. a moved "
                             "data.data_dir or data.tokenizer path) and train.*; model.* is refused")
    return parser


def eval_main(argv: list[str] | None = None) -> int:
    args = eval_parser().parse_args(argv)
    header = eval_header(args)
    if header:  # at once: the imports and the restore take seconds, a whole split minutes
        print(header, flush=True)
    lib = _train_extra()
    run = lib.RunDir(args.checkpoint)  # no log file where there is no run directory
    lib.send_library_logs_to(run.library_log_path if os.path.isdir(run.path) else None,
                         echo=args.debug)
    bar = _progress_bar(args.max_batches)
    try:
        result = lib.evaluate_checkpoint(args.checkpoint, step=args.step, split=args.split,
                                         seq_len=args.seq_len, max_batches=args.max_batches,
                                         batch_size=args.batch_size, output=args.output,
                                         overrides=args.overrides,
                                         on_batch=None if bar is None else bar.update)
    except lib.expected_errors as e:
        if args.debug:
            raise
        print(_one_line(e), file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    print(format_eval(result))
    if result.get("output_error"):
        print(f"error: {result['output_error']}", file=sys.stderr)
        return 2
    return 0


def eval_header(args: argparse.Namespace) -> str | None:
    """What ``eval.py`` is about to do, from the run directory alone (no JAX): checkpoint,
    step, split, sequence length, batch size and how many batches. None where the directory
    is not a readable run (the evaluation then says what is wrong)."""
    run = RunDir(args.checkpoint)
    try:
        cfg = run.load_config()
        steps = run.checkpoint_steps()
    except (OSError, ValueError):
        return None
    try:
        cfg = cfg.override(args.overrides)
    except ValueError:
        pass  # the evaluation refuses the override in one line
    if args.step is not None:
        step = str(args.step)
    elif steps:
        step = f"{steps[-1]} (the latest)"
    else:
        return None
    k = args.max_batches
    batches = (f"the first {k} batch{'es' if k > 1 else ''}" if k
               else "every batch of the split (--max-batches K: the first K)")
    return (f"eval: checkpoint {args.checkpoint}, step {step}, split "
            f"{args.split or cfg.data.eval_split}, T={args.seq_len or cfg.data.seq_len}, "
            f"batch {args.batch_size or cfg.train.batch_size}, {batches}")


def _progress_bar(total: int | None):
    """A tqdm bar of evaluated batches on a terminal, as ``train.py``'s steps; elsewhere (logs,
    CI, a pipe) None: nothing between the header and the results."""
    if not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="batch", desc="eval", dynamic_ncols=True, mininterval=1.0)


def format_eval(r: dict) -> str:
    from ls_jax.training.evaluate import format_perplexity
    lines = [
        f"checkpoint {r['workdir']} step {r['step']} ({r['config']}), split {r['split']}, "
        f"T={r['seq_len']}, {r['tokens']} tokens in {r['batches']} batches",
        f"loss {r['loss']:.4f} nats/token  perplexity {format_perplexity(r['perplexity'])}  "
        f"bits/byte {r['bits_per_byte']:.4f}",
        f"max |attention logit| {r['max_abs_logit']:.3f}  max |lm-head logit| "
        f"{r['lm_head_max_abs_logit']:.3f}",
        "max |attention logit| per layer x head:",
    ]
    for l, row in enumerate(r["attn_max_abs_logit"]):
        lines.append(f"  layer {l}: " + "  ".join(f"{v:8.3f}" for v in row))
    if r.get("output"):
        lines.append(f"written to {r['output']}")
    return "\n".join(lines)
