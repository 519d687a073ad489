"""What every service's ``main`` shares: arguments, logging, uvloop, clean shutdown."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Awaitable, Callable, Optional

from common.config import ClusterConfig

RunFn = Callable[[ClusterConfig, int], Awaitable[None]]


def parse_args(name: str, argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}")
    parser.add_argument("--config", help="cluster config (TOML); defaults otherwise")
    parser.add_argument("--index", type=int, default=0, help="instance index within its role")
    parser.add_argument("--log-level", default=os.environ.get("CRESCENT_LOG", "INFO"))
    return parser.parse_args(argv)


def setup_logging(name: str, index: int, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name}-{index} %(levelname)s %(name)s: %(message)s",
    )


def service_main(name: str, run: RunFn, argv: Optional[list[str]] = None) -> int:
    """Parse args, load the config, run ``run(config, index)`` until SIGINT/SIGTERM."""
    args = parse_args(name, argv)
    setup_logging(name, args.index, args.log_level)
    try:
        config = ClusterConfig.load(args.config)
    except (OSError, ValueError, TypeError) as exc:
        logging.getLogger(name).error("bad config: %s", exc)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def _main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        await run(config, args.index)

    try:
        asyncio.run(_main())
    except asyncio.CancelledError:
        pass
    except KeyboardInterrupt:
        pass
    return 0
