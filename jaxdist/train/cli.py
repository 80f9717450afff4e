"""The `jaxdist` command: `train`, `launch`, `plot`, `prepare-data` and `sample`.

jaxdist train [CONFIG.toml] [section.key=value ...]
jaxdist launch -n N [--cpu-devices D] -- jaxdist train ...
jaxdist plot RUN_DIR
jaxdist export RUN_DIR OUT [--format orbax|hf] [--shard-size 5GB] [--dtype bfloat16]
jaxdist prepare-data INPUT... --out DIR [--tokenizer bytes|FILE.json|hf:DIR | --train-bpe VOCAB]
jaxdist sample RUN_DIR --prompt TEXT --tokens N [--data DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

# Without GPUs the "default devices" are 8 simulated CPU devices. Only the CPU platform reads
# this flag, and only before JAX starts, so it is set here, before anything imports jax.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _train(args) -> int:
    from jaxdist.train import config as config_lib

    overrides = list(args.overrides)
    path = None
    if args.config and "=" not in args.config:
        path = args.config
    elif args.config:
        overrides.insert(0, args.config)
    from jaxdist.train.checkpoint import CheckpointError
    from jaxdist.train.ending import end_after_error, in_multi_process_run
    from jaxdist.train.loop_guards import NonFiniteLoss
    from jaxdist.train.metrics import MetricsError
    from jaxdist.train.process_zero import ProcessZeroError

    try:
        cfg = config_lib.load(path, overrides)
        from jaxdist.train.trainer import train

        train(cfg)
    except (config_lib.ConfigError, ValueError, CheckpointError, MetricsError, ProcessZeroError) as e:
        print(f"jaxdist train: error: {e}", file=sys.stderr)
        return end_after_error(2)
    except NonFiniteLoss as e:  # the run trained, then diverged: not a usage error
        print(f"jaxdist train: error: {e}", file=sys.stderr)
        return 1  # every process saw the same loss: they all reach jax's shutdown together
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not in_multi_process_run():
            raise
        if _peer_gone(e):  # the process whose error ended the run says why; this one only lost it
            line = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            print(
                "jaxdist train: error: a collective with another process failed (that process ended or lost its "
                f"connection; its own output may say why): {line}",
                file=sys.stderr,
            )
        else:
            traceback.print_exc()
        return end_after_error(1)
    return 0


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def _peer_gone(e: Exception) -> bool:
    """Whether `e` is a collective broken by a peer process's end (gloo's, NCCL's words for it)."""
    return type(e).__name__ == "JaxRuntimeError" and any(word in str(e) for word in _PEER_GONE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxdist", description="Train GPT, Llama and Gemma models with jaxdist's strategies."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    from jaxdist.train.config import describe

    t = sub.add_parser(
        "train",
        help="train a model (see jaxdist/train/configs/*.toml and docs/models.md)",
        description="Train a model: defaults, then the TOML file, then section.key=value overrides.",
        epilog="config keys (TOML [section] key = value, or section.key=value), with defaults:\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("config", nargs="?", help="a TOML config file (optional)")
    t.add_argument("overrides", nargs="*", help="section.key=value, e.g. run.steps=100 parallel.tp=2")
    la = sub.add_parser("launch", help="run a command as N local processes wired with jax.distributed")
    la.add_argument("-n", "--processes", type=int, required=True)
    la.add_argument("--cpu-devices", type=int, default=None, help="simulated CPU devices per process (no GPU)")
    la.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    la.add_argument(
        "--grace", type=float, default=30.0, help="seconds workers get after SIGTERM / Ctrl-C before they are killed"
    )
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- jaxdist train ...")
    ex = sub.add_parser("export", help="write a run's parameters as a plain orbax checkpoint (see README)")
    ex.add_argument("run_dir")
    ex.add_argument("out", help="the directory to write (must not exist)")
    ex.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest readable)")
    ex.add_argument(
        "--format", choices=("orbax", "hf"), default="orbax", help="orbax (default) or hf: a Hugging Face directory"
    )
    ex.add_argument(
        "--shard-size", default="5GB", help="hf: the most bytes per safetensors file (e.g. 5GB, 500MB; default 5GB)"
    )
    ex.add_argument(
        "--dtype",
        default=None,
        help="hf: store the tensors as float32, bfloat16 or float16 (or fp32, bf16, fp16; default: as trained)",
    )
    pl = sub.add_parser(
        "plot", help="draw the loss, throughput, learning rate and gradient norm curves of a run to RUN_DIR/curves.png"
    )
    pl.add_argument("run_dir")
    _add_data_commands(sub)
    args = ap.parse_args(argv)
    if args.command in _DATA_COMMANDS:
        return _DATA_COMMANDS[args.command](args)
    if args.command == "train":
        return _train(args)
    if args.command == "launch":
        from jaxdist.train.launch import launch

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return launch(cmd, args.processes, cpu_devices=args.cpu_devices, port=args.port, grace_s=args.grace)
    if args.command == "export":
        return _export(args)
    from jaxdist.train.plot import plot

    return plot(args.run_dir)


def _export(args) -> int:
    from jaxdist.train.checkpoint import CheckpointError
    from jaxdist.train.export import export

    try:
        if args.format == "hf":
            from jaxdist.train.export import export_hf

            step, out = export_hf(
                args.run_dir, args.out, args.step, shard_bytes=_byte_size(args.shard_size), dtype=args.dtype
            )
        else:
            step, out = export(args.run_dir, args.out, args.step)
    except CheckpointError as e:
        print(f"jaxdist export: error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: the parameters of step {step} of {args.run_dir}")
    return 0


_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def _byte_size(text: str) -> int:
    """`5GB`, `500MB`, `2GiB` or a plain number of bytes (transformers' max_shard_size spelling)."""
    from jaxdist.train.checkpoint import CheckpointError

    value = text.strip().upper()
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if value.endswith(u)), "")
    try:
        size = float(value[: len(value) - len(unit)]) * _UNITS.get(unit, 1)
    except ValueError:
        size = 0
    if not size >= 1:
        raise CheckpointError(f"--shard-size {text!r} is not a size; write e.g. 5GB, 500MB or a number of bytes")
    return int(size)


def _prepare_data(args) -> int:
    from jaxdist.train.data.prepare import prepare

    try:
        index = prepare(
            args.inputs,
            args.out,
            tokenizer=args.tokenizer,
            train_bpe=args.train_bpe,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            progress=not args.quiet,
        )
    except ValueError as e:
        print(f"jaxdist prepare-data: error: {e}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{s} {v['tokens']:,} tokens in {len(v['shards'])} shards" for s, v in index["splits"].items())
    print(f"{args.out}: vocabulary {index['vocab_size']:,} ({index['tokenizer_source']}), {counts}")
    return 0


def _sample(args) -> int:
    from jaxdist.train.sample import main as sample_main

    return sample_main(args)


_DATA_COMMANDS = {"prepare-data": _prepare_data, "sample": _sample}


def _add_data_commands(sub) -> None:
    pr = sub.add_parser("prepare-data", help="tokenize text files into shards for data.source=shards")
    pr.add_argument("inputs", nargs="+", help="UTF-8 text files, each one document")
    pr.add_argument("--out", required=True, help="the directory to write (must not exist or be empty)")
    pr.add_argument(
        "--tokenizer",
        default="bytes",
        help="'bytes' (default), a Hugging Face tokenizer.json, or a model directory holding one (DIR or hf:DIR)",
    )
    pr.add_argument("--train-bpe", type=int, default=0, metavar="VOCAB", help="learn a byte-level BPE of VOCAB tokens")
    pr.add_argument("--val-fraction", type=float, default=0.1, help="the end share of each file for validation")
    pr.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file")
    pr.add_argument("--quiet", action="store_true", help="no progress bar")
    sa = sub.add_parser("sample", help="generate text with the newest checkpoint of a run")
    sa.add_argument("run_dir")
    sa.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    sa.add_argument("--tokens", type=int, default=200, help="how many tokens to generate")
    sa.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    sa.add_argument("--top-k", type=int, default=0, help="draw among the k most likely tokens only (0: all)")
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--data", default=None, help="the prepared data directory with the tokenizer (default: the run's)")


if __name__ == "__main__":
    sys.exit(main())
