"""The Crescent Grafana dashboard, built with Grafana's own typed model (grafana-foundation-sdk).

``python -m launch.grafana.dashboard`` rewrites launch/grafana/dashboards/crescent.json, which
Grafana loads through the provisioning in launch/grafana/provisioning/ (docker-compose.yml).
The JSON is generated rather than hand-edited so that every panel, query and field is one
the Grafana schema has; tests/launch/test_monitoring.py checks that the file is this
output, that it survives Grafana's model unchanged, and that every metric a query names is
one Crescent exports.

Rows follow a request's path: the router (TTFT, TBT, requests, 429s), the workers' KV
blocks, the store (DRAM/SSD usage, hit rates), the KV transfers, prefill compute against
the time it waited on transfers, and each worker's own endpoint (step times, batch sizes,
KV bytes by path, transfer errors, quarantined blocks; by its ``worker`` target label).
"""
from __future__ import annotations

import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef

Panel = timeseries.Panel | stat.Panel
OUT = Path(__file__).with_name("dashboards") / "crescent.json"
UID = "crescent"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="crescent-prometheus")  # provisioned
RATE = "[$__rate_interval]"
QUANTILES = (0.5, 0.9, 0.99)


def query(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)


def percentiles(histogram: str) -> list[prometheus.Dataquery]:
    """p50, p90 and p99 of a histogram, over all its series."""
    return [query(f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{RATE})))",
                  f"p{round(q * 100)}") for q in QUANTILES]


def mean(histogram: str, by: str) -> str:
    """A histogram's mean per observation over the rate interval, per ``by`` labels."""
    return (f"sum by ({by}) (rate({histogram}_sum{RATE})) / "
            f"sum by ({by}) (rate({histogram}_count{RATE}))")


def graph(title: str, unit: str, targets: list[prometheus.Dataquery],
          description: str) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).height(8).span(12).line_width(1).fill_opacity(10))
    for ref, target in zip("ABCDEFGH", targets, strict=False):
        panel.with_target(target.ref_id(ref))
    return panel


def number(title: str, target: prometheus.Dataquery) -> stat.Panel:
    return (stat.Panel().title(title).datasource(DATASOURCE).height(4).span(12)
            .with_target(target.ref_id("A")))


def router_panels() -> list[Panel]:
    return [
        graph("Time to first token", "s",
              percentiles("crescent_router_time_to_first_token_seconds"),
              "Arrival at the router to the first streamed token."),
        graph("Time between tokens", "s",
              percentiles("crescent_router_inter_token_latency_seconds"),
              "Gap between consecutive output tokens of a stream."),
        graph("Requests by status", "reqps", [
            query(f"sum by (status) (rate(crescent_router_requests_total{RATE}))", "{{status}}"),
            query("sum(crescent_router_requests_in_flight)", "in flight")],
            "Finished generation requests per second by HTTP status, and those in flight."),
        graph("Rejected: 429s", "reqps", [
            query(f'sum(rate(crescent_router_requests_total{{status="429"}}{RATE}))',
                  "429 sent"),
            query(f"sum by (reason) (rate(crescent_conductor_rejected_total{RATE}))",
                  "admission: {{reason}}")],
            "Requests answered 429 by the router, and the conductor's admission rejections "
            "by reason."),
    ]


def worker_panels() -> list[Panel]:
    used = 'crescent_worker_kv_blocks{state="used"}'
    return [
        graph("KV blocks used per worker", "short", [query(used, "{{instance}}")],
              "Each worker's used KV blocks, from its last heartbeat to the conductor."),
        graph("KV block usage per worker", "percentunit", [
            query(f"{used} / ignoring (state) sum without (state) (crescent_worker_kv_blocks)",
                  "{{instance}}")], "Used / total KV blocks of each worker."),
        number("Live workers", query("crescent_workers", "{{role}}")),
        number("Requests in the conductor",
               query("crescent_conductor_in_flight", "admitted, unfinished")),
    ]


def store_panels() -> list[Panel]:
    hits = f'sum(rate(store_policy_events_total{{kind="hits"}}{RATE}))'
    misses = f'sum(rate(store_policy_events_total{{kind="misses"}}{RATE}))'
    prompt = f"sum(rate(crescent_prompt_tokens_total{RATE}))"
    return [
        graph("Store DRAM and SSD", "bytes", [
            query("sum by (tier) (store_used_bytes)", "{{tier}} used"),
            query("sum by (tier) (store_capacity_bytes)", "{{tier}} capacity")],
            "Bytes allocated in the global KV pool's DRAM segments and SSD tier, and their "
            "capacity."),
        graph("Hit rates", "percentunit", [
            query(f"{hits} / ({hits} + {misses})", "store gets (keys)"),
            query(f"sum(rate(crescent_cached_tokens_total{RATE})) / {prompt}",
                  "prompt tokens cached (local + global)"),
            query(f"sum(rate(crescent_global_cache_hit_tokens_total{RATE})) / {prompt}",
                  "prompt tokens from the store (global)")],
            "Keys found per key asked of the store, and the share of prompt tokens served "
            "from a KV cache: any (a worker's own or the store) and the store's."),
    ]


def transfer_panels() -> list[Panel]:
    return [
        graph("KV transfer rate", "Bps", [
            query(f"sum(rate(crescent_conductor_kv_transfer_bytes_total{RATE}))",
                  "prefill → decode")],
            "KV bytes per second moved from prefill to decode workers."),
        graph("KV bytes by flow and path", "Bps", [
            query(f"sum by (flow, path) (rate(crescent_worker_kv_bytes{RATE}))",
                  "{{flow}} via {{path}}")],
            "What workers move per second: to decode workers and to and from the store, "
            "through shared memory (one host) or the transfer engine (across hosts)."),
        graph("KV transfer time per request", "s",
              percentiles("crescent_conductor_kv_transfer_seconds"),
              "Time one request's KV stream was in flight prefill → decode (it overlaps "
              "compute)."),
    ]


def prefill_panels() -> list[Panel]:
    compute = "crescent_prefill_compute_seconds"
    wait = "crescent_prefill_transfer_wait_seconds"
    return [
        graph("Prefill compute vs transfer wait (per prompt)", "s", [
            query(mean(compute, "instance"), "{{instance}} compute"),
            query(mean(wait, "instance"), "{{instance}} transfer wait")],
            "Mean compute time of a prompt on each prefill instance, and the time it was "
            "blocked on transfers (store loads, the next pipeline stage, the last KV writes)."),
        graph("Prefill busy share", "percentunit", [
            query(f"sum by (instance) (rate({compute}_sum{RATE}))", "{{instance}} compute"),
            query(f"sum by (instance) (rate({wait}_sum{RATE}))", "{{instance}} transfer wait")],
            "Seconds of compute and of transfer wait per second, per prefill instance."),
    ]


def step_panels() -> list[Panel]:
    """From each worker's and store node's own /metrics (common/worker_metrics.py)."""
    steps = "crescent_worker_step_seconds_bucket"
    return [
        graph("Step time per worker", "s", [
            query(f"histogram_quantile({q}, sum by (le, worker, step) (rate({steps}{RATE})))",
                  f"{{{{worker}}}} {{{{step}}}} p{round(q * 100)}") for q in (0.5, 0.9)],
              "p50 and p90 wall time of an engine step on each worker, by kind (prefill, "
              "decode, mixed: a colocated step); a store node's tier commands."),
        graph("Batch size per worker", "short", [
            query(mean("crescent_worker_step_sequences", "worker, step"),
                  "{{worker}} {{step}} sequences"),
            query(mean("crescent_worker_step_tokens", "worker, step"),
                  "{{worker}} {{step}} tokens")],
              "Mean sequences and tokens per step: a decode step's batch, a prefill step's "
              "prompt chunks and their tokens."),
        graph("KV bytes by path per worker", "Bps", [
            query(f"sum by (worker, flow, path) (rate(crescent_worker_kv_moved_bytes_total"
                  f"{RATE}))", "{{worker}} {{flow}} via {{path}}")],
              "KV bytes per second each process moved, counted where they moved: to decode "
              "workers, hidden states to the next stage, to and from the store, a store "
              "node's tier moves and replicas."),
        graph("Transfer errors per worker", "short", [
            query(f"sum by (worker, path, kind) (increase(crescent_worker_transfer_errors_total"
                  f"{RATE}))", "{{worker}} {{kind}} via {{path}}")],
              "Failed copies: KV streams to decode workers, hidden states, store range "
              "copies, a store node's commands."),
        graph("Quarantined blocks and sequences per worker", "short", [
            query("crescent_worker_quarantined_blocks", "{{worker}} quarantined blocks"),
            query("crescent_worker_sequences", "{{worker}} {{state}}")],
              "Decode KV blocks held until their writer's word, and sequences running and "
              "queued, as of each worker's last heartbeat."),
    ]


ROWS = (("Requests (router)", router_panels), ("Workers", worker_panels),
        ("KV store", store_panels), ("KV transfers", transfer_panels),
        ("Prefill", prefill_panels), ("Worker steps (each worker's /metrics)", step_panels))


def build() -> str:
    """The dashboard's JSON, as written to ``OUT``."""
    d = (db.Dashboard("Crescent").uid(UID).tags(["crescent", "llm-serving"]).refresh("10s")
         .time("now-30m", "now").tooltip(DashboardCursorSync.CROSSHAIR).readonly())
    for title, panels in ROWS:
        d.with_row(db.Row(title))
        for panel in panels():
            d.with_panel(panel)
    dashboard = d.build()
    for n, panel in enumerate(dashboard.panels or [], 1):
        panel.id_val = n  # unique within the dashboard, stable across rebuilds
    return JSONEncoder(sort_keys=True, indent=2).encode(dashboard) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(build())
    print(f"wrote {OUT}", file=sys.stderr)
