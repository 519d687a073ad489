"""``crescent``: bring up a local cluster, run one service, fit the cost model of this
machine, or run the simulator."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

REPO = Path(__file__).resolve().parent.parent

if TYPE_CHECKING:
    from common.config import ClusterConfig


def remote_processes(config: "ClusterConfig") -> list[tuple[str, int, str]]:
    """(role, index, address) of each process whose address ([hosts], else ``host``) this
    machine cannot bind: 'up' would start it here under another host's name."""
    from common.health import layout

    out = []
    for role, index in layout(config):
        address = config.address(role, index)
        try:
            with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
                s.bind((address, 0))
        except OSError:
            out.append((role, index, address))
    return out


def cmd_up(args: argparse.Namespace) -> int:
    from launch.cluster import ClusterError, LocalCluster

    try:
        cluster = LocalCluster(args.config, args.log_dir, args.set)
    except ValueError as exc:  # a bad --set
        print(f"crescent: {exc}", file=sys.stderr)
        return 2
    c = cluster.config
    elsewhere = remote_processes(c)
    if elsewhere:
        listed = ", ".join(f"{role} {index} at {addr}" for role, index, addr in elsewhere)
        print(f"crescent: 'up' starts every process on this machine, but the config puts "
              f"{listed}, not an address of this machine; run 'crescent serve' on each "
              f"host instead (docs/multihost.md)", file=sys.stderr)
        return 2
    workers = (f"{c.colocated_workers} colocated" if c.mode == "colocated" else
               f"{c.prefill_workers} prefill, {c.decode_workers} decode")
    adapters = f", LoRA adapters {', '.join(c.lora_modules)}" if c.lora_modules else ""
    print(f"crescent: starting {workers}, {c.store.nodes if c.store.enabled else 0} store "
          f"node(s), model {c.model}{adapters} (logs in {args.log_dir})", flush=True)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cluster.say = lambda text: print(f"crescent: {text}", flush=True)
    try:
        cluster.start(timeout_s=args.timeout)
        print(f"crescent: ready — OpenAI API at {cluster.url}/v1 (Ctrl-C stops)", flush=True)
        while not stop["now"]:
            cluster.supervise()  # a child that exits is restarted ([supervise] table)
            time.sleep(0.2)
    except ClusterError as exc:
        print(f"crescent: {exc}", file=sys.stderr)
        return 1
    finally:
        print("crescent: stopping", flush=True)
        cluster.stop()
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure each compute role's phases on this machine again, one role at a time, each
    pinned as ``up`` pins that role's first worker, and replace the cached fits the
    workers price with (``cost_profile = "auto"``; common/engine/calibrate.py)."""
    from common.cpu import ENV_CPUS, ENV_THREADS, plan_env
    from launch.cluster import LocalCluster

    try:
        cluster = LocalCluster(args.config, ".crescent/logs", args.set)
    except ValueError as exc:
        print(f"crescent: {exc}", file=sys.stderr)
        return 2
    roles = ["colocated"] if cluster.config.mode == "colocated" else ["prefill", "decode"]
    for role in roles:
        env = {k: v for k, v in os.environ.items() if k not in (ENV_CPUS, ENV_THREADS)}
        plan = cluster.cpu_plan(role, 0)
        env.update(plan_env(plan) if plan is not None else {})
        command = [sys.executable, "-m", "common.engine.calibrate", "--role", role, "--force"]
        command += ["--config", args.config] if args.config else []
        command += [f"--set={item}" for item in args.set]
        print(f"crescent: calibrating {role} ...", flush=True)
        if subprocess.run(command, env=env, cwd=REPO).returncode != 0:
            print(f"crescent: calibrating {role} failed", file=sys.stderr)
            return 1
    return 0


def cmd_serve(argv: list[str]) -> int:
    """``crescent serve ROLE ARGS``: exactly ``python -m services.ROLE ARGS``."""
    from common.service import ROLES, bootstrap

    if not argv or argv[0] not in ROLES:
        print(f"usage: crescent serve {{{','.join(ROLES)}}} [--config FILE] [--index N] "
              "[--set KEY=VALUE ...]", file=sys.stderr)
        return 2
    return bootstrap(argv[0], argv[1:])


def cmd_keygen(args: argparse.Namespace) -> int:
    """``crescent keygen DIR``: the cluster's CURVE keypair (``[security] curve_key_dir``)."""
    from common.security import generate_keys, load_keys

    try:
        path, made = generate_keys(args.dir, force=args.force)
        public = load_keys(args.dir).public.decode()
    except (OSError, ValueError) as exc:
        print(f"crescent keygen: {exc}", file=sys.stderr)
        return 1
    print(f"crescent keygen: {'wrote' if made else 'kept the existing'} {path} "
          f"(public key {public}); set [security] curve_key_dir = \"{args.dir}\"", flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from launch.status import main as status_main

    return status_main(args.url, args.config, args.api_key, args.json, args.timeout,
                       args.requests)


def cmd_simulate(rest: list[str]) -> int:
    from traces.simulate import main as simulate_main

    return simulate_main(rest)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate":
        return cmd_simulate(argv[1:])
    if argv and argv[0] == "serve":
        return cmd_serve(argv[1:])
    parser = argparse.ArgumentParser(prog="crescent")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a whole local cluster")
    up.add_argument("--config", help="cluster config (TOML)")
    up.add_argument("--log-dir", default=".crescent/logs")
    up.add_argument("--timeout", type=float, default=180.0)
    up.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting over the config file, for every process "
                         "(e.g. model=/models/Qwen3-0.6B); repeatable")
    calibrate = sub.add_parser("calibrate", help="fit the cost model of this machine's "
                               "workers again (cost_profile = \"auto\")")
    calibrate.add_argument("--config", help="cluster config (TOML)")
    calibrate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="a setting over the config file; repeatable")
    sub.add_parser("serve", help="run one service (multi-host deployments; "
                   "see crescent serve ROLE -h)")
    sub.add_parser("simulate", help="replay a Mooncake trace (see crescent simulate -h)")
    keygen = sub.add_parser("keygen", help="make the cluster's CURVE keypair in DIR "
                            "(kept if one is there)")
    keygen.add_argument("dir")
    keygen.add_argument("--force", action="store_true", help="replace an existing keypair")
    status = sub.add_parser("status", help="the cluster's live numbers (the router's "
                            "/dashboard) as tables")
    status.add_argument("--url", help="the router (default: http://host:http_port of "
                        "--config)")
    status.add_argument("--config", help="cluster config (TOML)")
    status.add_argument("--api-key", help="when the router has API keys (default: "
                        "$CRESCENT_API_KEY)")
    status.add_argument("--json", action="store_true", help="print the JSON as served")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait")
    status.add_argument("--requests", type=int, default=10, help="last requests shown")
    args = parser.parse_args(argv)
    if args.command == "keygen":
        return cmd_keygen(args)
    if args.command == "status":
        return cmd_status(args)
    if args.command == "calibrate":
        return cmd_calibrate(args)
    return cmd_up(args)


if __name__ == "__main__":
    sys.exit(main())
