"""The `jaxdist` command: `train`, `launch` and `plot`.

jaxdist train [CONFIG.toml] [section.key=value ...]
jaxdist launch -n N [--cpu-devices D] -- jaxdist train ...
jaxdist plot RUN_DIR
"""

from __future__ import annotations

import argparse
import os
import sys

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

    try:
        cfg = config_lib.load(path, overrides)
        from jaxdist.train.trainer import train

        train(cfg)
    except (config_lib.ConfigError, ValueError, CheckpointError) as e:
        print(f"jaxdist train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxdist", description="Train GPTs with jaxdist's strategies.")
    sub = ap.add_subparsers(dest="command", required=True)
    from jaxdist.train.config import describe

    t = sub.add_parser(
        "train",
        help="train a GPT (see jaxdist/train/configs/*.toml)",
        description="Train a GPT: defaults, then the TOML file, then section.key=value overrides.",
        epilog="config keys (TOML [section] key = value, or section.key=value), with defaults:\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("config", nargs="?", help="a TOML config file (optional)")
    t.add_argument("overrides", nargs="*", help="section.key=value, e.g. run.steps=100 parallel.tp=2")
    la = sub.add_parser("launch", help="run a command as N local processes wired with jax.distributed")
    la.add_argument("-n", "--processes", type=int, required=True)
    la.add_argument("--cpu-devices", type=int, default=None, help="simulated CPU devices per process (no GPU)")
    la.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- jaxdist train ...")
    pl = sub.add_parser("plot", help="draw loss and throughput of a run to RUN_DIR/curves.png")
    pl.add_argument("run_dir")
    args = ap.parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "launch":
        from jaxdist.train.launch import launch

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return launch(cmd, args.processes, cpu_devices=args.cpu_devices, port=args.port)
    from jaxdist.train.plot import plot

    return plot(args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
