"""Start service processes by forking one that has already imported what they import.

A model worker spends about 2.5 s of CPU importing torch and the services' modules before
it reads its config, and 1.6 s building its engine; the test suite starts some 200
processes. The fork server (``python -m launch.forkserver``) imports every role's module
and builds the default model once (``preload``), then
forks a process per request that runs the same bootstrap as ``python -m
services.<role>`` (common/service.py), in its own session, with its own environment,
working directory and log, and fresh random seeds.

The service is not the server's child: the server forks an intermediate process that
forks the service and exits at once, and the launcher is a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so the orphaned service becomes the launcher's child. The
launcher waits on it and signals it like a child it started itself (``ForkedProcess``:
the part of ``subprocess.Popen`` that launch/cluster.py uses), with its real exit status.

What differs from a process started with ``exec``: ``/proc/PID/cmdline`` and
``/proc/PID/environ`` show the server's (the process's ``os.environ`` is its own), and
the modules of every role are loaded. ``crescent up`` starts its processes with ``exec``,
so an operator's ``ps`` and ``pgrep`` name each role; the tests use the fork server
(``shared``). The server forks only while it has one thread (a fork copies only the
thread that calls it); it answers a request it cannot serve with an error, never hangs.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import io
import json
import os
import random
import select
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
PR_SET_CHILD_SUBREAPER = 36
REPLY_S = 30.0  # a fork answers in milliseconds
PRELOAD_S = 180.0  # the first answer waits for the imports (seconds; more on a busy box)


class ForkServerError(RuntimeError):
    pass


class ForkedProcess:
    """A service forked by the server, reparented to this (subreaper) process: ``pid``,
    ``args``, ``returncode``, ``poll`` and ``wait`` as ``subprocess.Popen`` has them."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: Optional[int] = None
        self._lock = threading.Lock()  # a supervising thread and a test both poll

    def poll(self) -> Optional[int]:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        return code


class ForkServer:
    """The launcher's side: starts the server and asks it for services."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise ForkServerError(f"prctl(PR_SET_CHILD_SUBREAPER): "
                                  f"{os.strerror(ctypes.get_errno())}")
        env = dict(os.environ)  # a child's own comes with its request
        env.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's import starts no thread
        self._lock = threading.Lock()
        self._answered = False
        self.proc = subprocess.Popen([sys.executable, "-m", "launch.forkserver"], cwd=REPO,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)

    def spawn(self, role: str, args: list[str], env: dict[str, str], cwd: Path,
              log_path: Path) -> ForkedProcess:
        """Fork ``python -m services.<role> ARGS``, its output appended to ``log_path``."""
        request = {"role": role, "args": args, "env": env, "cwd": str(cwd),
                   "log": str(log_path)}
        with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise ForkServerError(f"the fork server exited ({self.proc.poll()})") from None
            reply = _read_reply(self.proc, REPLY_S if self._answered else PRELOAD_S)
            self._answered = True
        if "error" in reply:
            raise ForkServerError(reply["error"])
        return ForkedProcess(reply["pid"], [sys.executable, "-m", f"services.{role}", *args])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def _read_reply(proc: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else b""
    if not line:
        raise ForkServerError(f"the fork server gave no answer within {timeout_s:g} s "
                              f"(exit code {proc.poll()})")
    return json.loads(line)


_shared: Optional[ForkServer] = None


def shared() -> ForkServer:
    """This process's fork server, started on first use and killed at exit."""
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        _shared = ForkServer()
        atexit.register(_shared.close)
    return _shared


# ------------------------------------------------------------------ the server's side
_TORCH_THREADS = 0  # torch's default intra-op thread count, before preload set one


def preload() -> None:
    """Import what every role imports (common/service.py ``ROLES``), and build the default
    model (common/engine/engine.py ``prebuild``: float32 on the CPU, every layer), which
    a worker of that model then shares instead of loading and packing its own (about 1.2 s
    of CPU each). torch computes on one thread here, so that no OpenMP thread exists at a
    fork; a forked service starts from torch's default count (``_become``)."""
    from common.service import ROLES

    for role in ROLES.values():
        importlib.import_module(role.module)
    import torch

    from common.engine import EngineConfig, UnknownModelError
    from common.engine.engine import prebuild

    global _TORCH_THREADS
    _TORCH_THREADS = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prebuild(EngineConfig())
    except UnknownModelError as exc:  # not installed: each worker says so itself
        print(f"fork server: default model not built ahead ({exc})", file=sys.stderr)


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def fork_service(request: dict[str, Any]) -> int:
    """Fork the intermediate that forks the service; its pid once the intermediate has
    exited (the service is then the subreaper's child)."""
    if (n := threads()) != 1:
        raise ForkServerError(f"the fork server has {n} threads; it forks only with one")
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        code = 0
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _become(request)
            os.write(w, str(pid).encode())
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        text = pipe.read()
    os.waitpid(middle, 0)
    if not text:
        raise ForkServerError(f"could not fork services.{request['role']}")
    return int(text)


def _become(request: dict[str, Any]) -> None:
    """In the forked service: what ``exec`` would have given it, then the bootstrap."""
    code = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdout = _unbuffered(1)
        sys.stderr = _unbuffered(2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()
        if _TORCH_THREADS:
            sys.modules["torch"].set_num_threads(_TORCH_THREADS)  # a CPU plan may set others
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        role = request["role"]
        sys.argv = [str(REPO / "services" / role / "__main__.py"), *request["args"]]
        from common.service import bootstrap

        code = bootstrap(role)  # returns only when the service could not start
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        from common.service import leave

        leave(code)  # what an exec'd service's exit would have run, then os._exit


def _unbuffered(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                            errors="backslashreplace", write_through=True)


def main() -> int:
    preload()
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    for line in iter(requests.readline, b""):
        try:
            reply: dict[str, Any] = {"pid": fork_service(json.loads(line))}
        except Exception as exc:  # the request is answered; the server goes on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
