"""Sample text from a trained run: ``python -m ls_jax.inference.sample --checkpoint DIR --prompt "..."``.

The run directory gives the config (``config.json``) and with it the tokenizer; only the model
parameters are read from the checkpoint (the optimizer state stays on disk). Prints the
prompt and its continuation, then the token counts and tokens/s. Without
``--max-new-tokens``, up to ``DEFAULT_NEW_TOKENS``, as many as fit after the prompt in a
model with learned positions. Bad input: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import sys

_DTYPES = ("bfloat16", "float32")
DEFAULT_NEW_TOKENS = 200


def default_new_tokens(model_cfg, prompt_len: int) -> int:
    """``DEFAULT_NEW_TOKENS``, or fewer where learned positions leave less room after the
    prompt (a prompt that fills the table is left for ``generate`` to refuse)."""
    if model_cfg.pos_embedding != "learned":
        return DEFAULT_NEW_TOKENS
    return max(1, min(DEFAULT_NEW_TOKENS, model_cfg.max_seq_len - prompt_len))


def load_model(workdir: str, step: int | None = None):
    """(model, Config, step) of the run in ``workdir``: the model's parameters only (the
    optimizer state stays on disk; ``ls_jax.training.state.restore_model``)."""
    from ls_jax.training.rundir import RunDir
    from ls_jax.training.state import restore_model

    cfg, step, model = restore_model(RunDir(workdir), step)
    return model, cfg, step


def build_parser() -> argparse.ArgumentParser:
    """The sampling command line (``python -m ls_jax.inference.sample``, ``ls-jax-sample``)."""
    parser = argparse.ArgumentParser(
        prog="python -m ls_jax.inference.sample",
        description="Generate text with a model trained by train.py (KV-cache decoding).")
    parser.add_argument("--checkpoint", required=True, help="the run directory (train --workdir)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"default: {DEFAULT_NEW_TOKENS}, or as many as fit after the prompt "
                             f"(learned positions: model.max_seq_len)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-stop", action="store_true",
                        help="do not stop at the tokenizer's end-of-document token")
    parser.add_argument("--chunk-size", type=int, default=512, help="prefill chunk length")
    parser.add_argument("--cache-dtype", default="bfloat16", choices=_DTYPES)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    try:
        import jax.numpy as jnp

        from ls_jax.training.checkpoint import CheckpointError
        from ls_jax.inference.generate import generate
        from ls_jax.training.rundir import RunDir
        from ls_jax.inputs.tokenizer import make_tokenizer
    except ModuleNotFoundError as e:  # not the venv, or no [train] extra: one line, exit 2
        from ls_jax.run_hint import how_to_run
        print(how_to_run(e, ["-m", "ls_jax.inference.sample", *(sys.argv[1:] if argv is None else argv)],
                         "sample", "sampling"), file=sys.stderr)
        return 2

    try:
        if not args.prompt:
            raise ValueError("--prompt: expected a non-empty text, got ''")
        cfg = RunDir(args.checkpoint).load_config()
        tokenizer = make_tokenizer(cfg.data.tokenizer)
        prompt_ids = tokenizer.encode(args.prompt)
        if prompt_ids.size == 0:
            raise ValueError(f"--prompt: {args.prompt!r} encodes to no tokens")
        model, cfg, step = load_model(args.checkpoint, args.step)
        max_new = args.max_new_tokens
        if max_new is None:
            max_new = default_new_tokens(cfg.model, len(prompt_ids))
        result = generate(
            model, prompt_ids, max_new_tokens=max_new,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            end_id=None if args.no_stop else tokenizer.eos_id, chunk_size=args.chunk_size,
            cache_dtype=jnp.dtype(args.cache_dtype))
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    new = result.tokens[0]
    print(args.prompt + tokenizer.decode(new))
    rate = len(new) / result.decode_seconds if result.decode_seconds > 0 else float("nan")
    print(f"--\nstep {step}: {len(prompt_ids)} prompt + {len(new)} new tokens; prefill "
          f"{result.prefill_seconds:.2f} s, decode {result.decode_seconds:.2f} s "
          f"({rate:.1f} tokens/s; {result.compile_seconds:.2f} s compiling it)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
