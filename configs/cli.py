"""Argument parsing and entry functions behind the thin ``train.py`` and ``eval.py`` scripts.

It sits above the library: it resolves named configs (this package) and calls ``ls_jax``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from ls_jax.configs import get_config

try:
    from ls_jax.checkpoint import CheckpointError
    from ls_jax.evaluate import evaluate_checkpoint
    from ls_jax.rundir import WorkdirLocked
    from ls_jax.sharding import maybe_initialize_distributed
    from ls_jax.train import TrainingDiverged, train
except ModuleNotFoundError as e:  # a core-only install: `pip install ls-jax` without [train]
    raise SystemExit(f"error: training and evaluation need the [train] extra (missing module "
                     f"{e.name!r}): pip install 'ls-jax[train]'") from e

# Errors a user can cause or fix (bad input, a locked or damaged run directory, a full disk, a
# diverged run): one line on stderr and a non-zero exit; anything else is a bug (traceback).
EXPECTED_ERRORS = (ValueError, OSError, ImportError, CheckpointError, WorkdirLocked,
                   TrainingDiverged)


class _NoTraceback(logging.Filter):
    """Drops the traceback of a library's log record (orbax logs one for a failed async save);
    the record's own line stays, and the CLI's one ``error:`` line names the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def quiet_library_tracebacks() -> None:
    """Without ``--debug``: library log records (absl: orbax, grain) without tracebacks, and no
    warning about the never-awaited writes of an aborted save."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _NoTraceback) for f in logger.filters):
        logger.addFilter(_NoTraceback())
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"error: {text or type(e).__name__}"


def train_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Train an LS-attention language model.",
        epilog="Example: python train.py --config tiny --workdir runs/tiny train.num_steps=200")
    parser.add_argument("--config", default="tiny", help="named config (configs/): %(default)s")
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
    args = parser.parse_args(argv)
    try:
        cfg = get_config(args.config, args.overrides)
    except ValueError as e:
        parser.error(str(e))
    maybe_initialize_distributed(args.distributed)
    if not args.debug:
        quiet_library_tracebacks()
    workdir = args.workdir or f"runs/{cfg.name}"
    try:
        if args.compile_only is not None:
            from ls_jax.compile_only import compile_only_main
            return compile_only_main(cfg, args.compile_only)
        result = train(cfg, workdir)
    except EXPECTED_ERRORS as e:
        if args.debug:
            raise
        print(_one_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the first step: no save
        if args.debug:
            raise
        print(f"error: interrupted without saving; rerun the same command to resume from the "
              f"last checkpoint in {workdir}", file=sys.stderr)
        return 130
    print(f"done: step {result.final_step} in {workdir}"
          + (" (interrupted; rerun the same command to resume)" if result.interrupted else ""))
    return 0


def eval_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Evaluate a checkpoint written by train.py.")
    parser.add_argument("--checkpoint", required=True, help="the run directory (train --workdir)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--split", default=None, help="data split (default: the config's eval split)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length (default: training's); may differ, for length generalisation")
    parser.add_argument("--max-batches", type=int, default=None, help="cap on batches (default: all)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: training's")
    parser.add_argument("--output", default=None, help="JSON output path")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error instead of one line")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides that leave the model alone: data.* (e.g. a moved "
                             "data.data_dir or data.tokenizer path) and train.*; model.* is refused")
    args = parser.parse_args(argv)
    if not args.debug:
        quiet_library_tracebacks()
    try:
        result = evaluate_checkpoint(args.checkpoint, step=args.step, split=args.split,
                                     seq_len=args.seq_len, max_batches=args.max_batches,
                                     batch_size=args.batch_size, output=args.output,
                                     overrides=args.overrides)
    except EXPECTED_ERRORS as e:
        if args.debug:
            raise
        print(_one_line(e), file=sys.stderr)
        return 2
    print(format_eval(result))
    if result.get("output_error"):
        print(f"error: {result['output_error']}", file=sys.stderr)
        return 2
    return 0


def format_eval(r: dict) -> str:
    lines = [
        f"checkpoint {r['workdir']} step {r['step']} ({r['config']}), split {r['split']}, "
        f"T={r['seq_len']}, {r['tokens']} tokens in {r['batches']} batches",
        f"loss {r['loss']:.4f} nats/token  perplexity {r['perplexity']:.3f}  "
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
