"""``crescent status``: the dashboard's numbers in the terminal.

Fetches the router's ``GET /debug/dashboard`` (the JSON the ``/dashboard`` page polls,
docs/dashboard.md) once, under a deadline, and prints it as tables: workers, the store,
admission and KV transfer, the last requests' phases. ``--json`` prints the JSON as is.
"""
from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, Optional

from rich import box
from rich.console import Console
from rich.table import Table

PHASES = ("queued", "prefill", "transfer", "decode")


class StatusError(Exception):
    """The router could not be asked, or answered with something else than the data."""


def fetch(url: str, api_key: Optional[str], timeout_s: float) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(url.rstrip("/") + "/debug/dashboard", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        hint = " (give --api-key or set CRESCENT_API_KEY)" if exc.code == 401 else ""
        raise StatusError(f"{url} answered {exc.code}{hint}") from None
    except (OSError, ValueError) as exc:  # refused, timed out, not JSON
        raise StatusError(f"cannot read {url}/debug/dashboard: {exc}") from None


def _num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def _bytes(v: Optional[float]) -> str:
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


def _secs(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{1000 * v:.0f} ms" if v < 1 else f"{v:.2f} s"


def _table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, title_style="bold")
    for i, name in enumerate(columns):
        t.add_column(name, justify="left" if i < 2 else "right")
    return t


def workers_table(d: dict[str, Any]) -> Table:
    t = _table("Workers", "instance", "role", "used", "free", "total", "cached", "queue",
               "queued tok", "running", "context tok", "assigned", "heartbeat")
    for w in d["workers"]:
        t.add_row(w["instance_id"] + (" (draining)" if w["draining"] else ""), w["role"],
                  *(_num(w[k]) for k in ("used_blocks", "free_blocks", "total_blocks",
                                         "cached_blocks", "queued", "queued_tokens",
                                         "running", "context_tokens", "assigned")),
                  _secs(w["heartbeat_age_s"]))
    return t


def store_table(s: dict[str, Any]) -> Table:
    t = _table("KV store", "figure", "value")
    k = s["counters"]
    t.add_row("DRAM", f"{_bytes(s['dram_used'])} / {_bytes(s['dram_capacity'])}")
    t.add_row("SSD", f"{_bytes(s['ssd_used'])} / {_bytes(s['ssd_capacity'])}"
              if s["ssd_capacity"] else "none configured")
    t.add_row("key hit rate", f"{_pct(s['hit_rate'])} ({_num(k.get('hits', 0))} hits, "
              f"{_num(k.get('misses', 0))} misses)")
    t.add_row("objects", f"{_num(s['objects'])} on {_num(s['nodes'])} node(s)")
    t.add_row("evicted / offloaded / promoted", " / ".join(
        _num(k.get(name, 0)) for name in ("evicted", "offloaded", "promoted")))
    t.add_row("global index", f"{_num(s['index_keys'])} keys, {s['index_state'] or '-'}")
    t.add_row("master answered", f"{_secs(s['age_s'])} ago")
    return t


def traffic_table(d: dict[str, Any]) -> Table:
    a, x, c = d["admission"], d["transfer"], d["cache"]
    t = _table("Traffic", "figure", "value")
    t.add_row("in flight", _num(a["in_flight"]))
    t.add_row(f"admitted (last {a['window_s']} s)", f"{a['admitted_per_s']:.1f} /s")
    t.add_row("refused 429", f"{_num(a['rejected_429'])} ({a['rejected_per_s']:.1f} /s)")
    t.add_row("HTTP outcomes", ", ".join(f"{k}: {_num(v)}" for k, v in a["http"].items())
              or "-")
    if a["conductor"] is not None:
        cond = a["conductor"]
        t.add_row("placed", _num(cond["placed"]))
        for what in ("rejected", "failed"):
            t.add_row(f"{what} by reason", ", ".join(
                f"{k}: {_num(v)}" for k, v in sorted(cond[what].items())) or "none")
    if x is not None:
        t.add_row(f"KV transfer (last {x['window_s']} s)", f"{_bytes(x['bytes_per_s'])}/s")
        t.add_row("KV moved", f"{_bytes(x['bytes'])} in {_num(x['transfers'])} transfers")
    if c is not None:
        t.add_row("local cache hits", f"{_pct(c['local_hit_rate'])} "
                  f"({_num(c['local_hit_tokens'])} of {_num(c['prompt_tokens'])} tokens)")
        t.add_row("global (store) hits", f"{_pct(c['global_hit_rate'])} "
                  f"({_num(c['global_hit_tokens'])} of {_num(c['prompt_tokens'])} tokens)")
    return t


def requests_table(d: dict[str, Any], limit: int) -> Table:
    """The last requests; with several routers, every router's, each named."""
    named = d.get("routers", 1) > 1
    t = _table("Last requests", *(["router"] if named else []), "request", "status", *PHASES,
               "total", "tokens in/cached/out")
    t.columns[int(named)].no_wrap = True
    for r in d["requests"][:limit]:
        phases = [r["phases"][p] for p in PHASES]
        t.add_row(*([r["router"]] if named else []), r["request_id"], str(r["status"]),
                  *map(_secs, phases), _secs(sum(phases)),
                  f"{r['prompt_tokens']}/{r['cached_tokens']}/{r['output_tokens']}")
    return t


def render(d: dict[str, Any], console: Console, limit: int = 10) -> None:
    state = "draining" if d["draining"] else "ready" if d["ready"] else "NOT READY"
    age = d["status_age_s"]
    console.print(f"[bold]Crescent[/bold] {d['model']}: {state}; conductor status "
                  f"{'never' if age is None else _secs(age) + ' ago'}", highlight=False)
    if d.get("routers", 1) > 1:  # the rates are the answering router's, the log all of theirs
        silent = d.get("routers_silent") or []
        console.print(f"{d['router']} of {d['routers']} routers answered (its own rates)"
                      + (f"; no answer from {', '.join(silent)}" if silent else ""),
                      highlight=False)
    console.print(workers_table(d))
    if d["store"] is not None:
        console.print(store_table(d["store"]))
    console.print(traffic_table(d))
    if d["requests"]:
        console.print(requests_table(d, limit))


def router_url(config_path: Optional[str]) -> str:
    from common.config import ClusterConfig

    try:
        config = ClusterConfig.load(config_path)
    except (OSError, ValueError) as exc:  # unreadable, not TOML, or invalid
        raise StatusError(f"config {config_path}: {exc}") from None
    return f"http://{config.address('router')}:{config.http_port}"


def main(url: Optional[str], config_path: Optional[str], api_key: Optional[str],
         as_json: bool, timeout_s: float, limit: int) -> int:
    console = Console(width=max(120, Console().width), highlight=False)
    try:
        base = url or router_url(config_path)
        data = fetch(base, api_key or os.environ.get("CRESCENT_API_KEY"), timeout_s)
    except StatusError as exc:
        print(f"crescent status: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        render(data, console, limit)
    return 0
