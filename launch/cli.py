"""``crescent``: bring up a local cluster, run one service, or run the simulator."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
from typing import Optional

ROLES = ("router", "conductor", "prefill", "decode", "store_master", "store_node")


def cmd_up(args: argparse.Namespace) -> int:
    from launch.cluster import ClusterError, LocalCluster

    cluster = LocalCluster(args.config, args.log_dir)
    c = cluster.config
    print(f"crescent: starting {c.prefill_workers} prefill, {c.decode_workers} decode, "
          f"{c.store_nodes if c.use_store else 0} store node(s), model {c.model} "
          f"(logs in {args.log_dir})", flush=True)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start(timeout_s=args.timeout)
        print(f"crescent: ready — OpenAI API at {cluster.url}/v1 (Ctrl-C stops)", flush=True)
        while not stop["now"]:
            cluster.check_alive()
            time.sleep(0.5)
    except ClusterError as exc:
        print(f"crescent: {exc}", file=sys.stderr)
        return 1
    finally:
        print("crescent: stopping", flush=True)
        cluster.stop()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from common.config import ClusterConfig
    from launch.cluster import service_args

    module = importlib.import_module(f"services.{args.role}")
    config = ClusterConfig.load(args.config)
    return module.main(service_args(args.role, args.index, config, args.config))


def cmd_simulate(rest: list[str]) -> int:
    from traces.simulate import main as simulate_main

    return simulate_main(rest)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate":
        return cmd_simulate(argv[1:])
    parser = argparse.ArgumentParser(prog="crescent")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a whole local cluster")
    up.add_argument("--config", help="cluster config (TOML)")
    up.add_argument("--log-dir", default=".crescent/logs")
    up.add_argument("--timeout", type=float, default=180.0)
    serve = sub.add_parser("serve", help="run one service (multi-host deployments)")
    serve.add_argument("role", choices=ROLES)
    serve.add_argument("--index", type=int, default=0)
    serve.add_argument("--config")
    sub.add_parser("simulate", help="replay a Mooncake trace (see crescent simulate -h)")
    args = parser.parse_args(argv)
    return {"up": cmd_up, "serve": cmd_serve}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
