"""The one bootstrap of every service: ``python -m services.<role>`` is ``bootstrap(role)``.

Every process of a cluster starts the same way, in this order:

1. pin itself to the CPU plan in its environment (common/cpu.py), before any thread exists,
   and bound torch's per-shape oneDNN caches (common/native_caches.py);
2. parse the same arguments: ``--config FILE --index N --set key=value ... --log-level L``;
3. load the cluster config (the TOML file, then each ``--set`` laid over it), install its
   cluster key for CURVE if it names one (common/security.py), and log as ``<role>-<index>``;
4. install uvloop; SIGINT cancels the main task, SIGTERM first drains (common/drain.py:
   a service that registered in-flight work finishes it, up to
   ``supervise.drain_timeout_s``, taking nothing new) and then cancels it; with
   ``CRESCENT_TRACEMALLOC`` set, SIGUSR2 reports where Python memory grew (common/memtrace.py),
   and with ``CRESCENT_TIMELINE_DIR`` set requests' stages are timed (common/timeline.py);
5. import the role's module (``ROLES``) and await its ``run(config, index)`` until cancelled,
   answering ``GET /health`` meanwhile if the config sets ``health_port`` (common/health.py);
6. once ``run`` has returned or failed to start, leave at once (``leave``): the service has
   closed what it owns, so the interpreter's own teardown is skipped.

Every address, port and setting a service uses comes from that one config (common/config.py).
Exit codes: 0 a clean stop; 1 the service could not start (a port taken, the store master
unreachable, a model it cannot serve: ``StartupError`` or ``OSError``, one line on stderr)
or a CPU plan that cannot be applied; 2 a bad config or argument. Anything else is a crash
with its traceback.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import importlib
import logging
import os
import signal
import sys
import tomllib
from dataclasses import dataclass
from typing import Any, NoReturn, Optional

log = logging.getLogger("crescent.service")


@dataclass(frozen=True)
class Role:
    module: str  # where ``async def run(config: ClusterConfig, index: int)`` lives
    computes: bool  # runs torch: its intra-op thread count is set with its CPU plan


ROLES: dict[str, Role] = {
    "router": Role("services.router.app", computes=False),
    "conductor": Role("services.conductor.service", computes=False),
    "prefill": Role("services.prefill.service", computes=True),
    "decode": Role("services.decode.service", computes=True),
    "colocated": Role("services.colocated.service", computes=True),
    "store_master": Role("services.store_master.server", computes=False),
    "store_node": Role("services.store_node.server", computes=False),
}


class StartupError(RuntimeError):
    """A service cannot start (a dependency unreachable): exit 1 with one line, no trace."""


def parse_args(role: str, argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m services.{role}",
                                     description=f"Run one Crescent {role} process.")
    parser.add_argument("--config", help="cluster config (TOML); defaults otherwise")
    parser.add_argument("--index", type=int, default=0, help="instance index within its role")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override one config field, TOML syntax "
                        "with dotted tables: --set http_port=8001 --set store.policy.lease_s=2")
    parser.add_argument("--log-level", default=os.environ.get("CRESCENT_LOG", "INFO"))
    return parser.parse_args(argv)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "host=10.0.0.2"]`` → ``{"a": {"b": 1}, "host": "10.0.0.2"}``: each value
    is a TOML value, or a plain string where it does not parse as one."""
    from common.config_load import merge

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            one = tomllib.loads(f"{key.strip()} = {value.strip()}")
        except tomllib.TOMLDecodeError:
            try:
                one = tomllib.loads(f"{key.strip()} = {_toml_string(value.strip())}")
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"--set {item!r}: {exc}") from None
        out = merge(out, one)
    return out


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def setup_logging(name: str, index: int, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name}-{index} %(levelname)s %(name)s: %(message)s",
    )


def bootstrap(role: str, argv: Optional[list[str]] = None) -> int:
    """Start the ``role`` process of a cluster; returns its exit code if it cannot start
    (a bad config), and otherwise ends the process itself (``leave``; see the module doc)."""
    from common import health, memtrace, native_caches, timeline
    from common.cpu import CpuError, apply_from_env
    from common.drain import install as install_drain

    spec = ROLES[role]
    native_caches.bound(role)  # before the first matmul
    try:
        apply_from_env(role, torch_threads=spec.computes)  # first: before any thread exists
    except CpuError as exc:
        print(f"{role}: {exc}", file=sys.stderr, flush=True)
        return 1
    args = parse_args(role, argv)
    setup_logging(role, args.index, args.log_level)
    from common.config import ClusterConfig
    from common.security import install as install_security

    try:
        config = ClusterConfig.load(args.config, parse_overrides(args.overrides))
        install_security(config.security)  # the cluster key for every socket (CURVE)
        trace = memtrace.start(f"{role}-{args.index}")  # None unless asked for
        timeline.start(role, args.index)  # likewise
    except (OSError, ValueError, TypeError) as exc:
        log.error("bad config: %s", exc)
        return 2
    log.info("bootstrap: %s-%d (pid %d, config %s)", role, args.index, os.getpid(),
             args.config or "defaults")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    run = importlib.import_module(spec.module).run

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        drain = install_drain(config.supervise.drain_timeout_s)
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        loop.add_signal_handler(signal.SIGTERM, drain.begin, task)
        memtrace.install(trace, loop)
        async with health.serve(config, role, args.index):
            await run(config, args.index)

    code = 0
    try:
        asyncio.run(main())
    except (asyncio.CancelledError, KeyboardInterrupt):
        pass  # SIGINT / SIGTERM: a clean stop
    except (StartupError, OSError) as exc:
        log.error("%s-%d could not start: %s", role, args.index, exc)
        code = 1
    leave(code)


def leave(code: int) -> NoReturn:
    """End this service process now, with ``code``: run the ``atexit`` handlers (a KV
    segment's unlink, common/kv/shm_kv.py), flush the logs, and skip the interpreter's
    teardown. That teardown did nothing the service needs and took 1.5-2 s of every stop: a
    final garbage collection over torch's and transformers' modules (about 1 s of CPU), and
    the transfer engine's destructor joining its handshake thread, which polls once a
    second. Threads still running (idle executor workers) end with the process."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
