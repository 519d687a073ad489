"""Chunked pipeline parallelism and layer-wise KV I/O on real clusters: greedy outputs are
identical whether a prefill instance is one process or a group of 2 or 3 stages, and
whether KV moves layer by layer or in whole blocks, including a prefix loaded from the
store by the other prefill instance; afterwards no worker holds a block."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from prometheus_client.parser import text_string_to_metric_families

from launch.cluster import LocalCluster
from tests.e2e.conftest import start_cluster, wait_no_leaks
from tests.multihost.conftest import conductor_metrics, kv_bytes

pytestmark = pytest.mark.e2e  # boots clusters: not in `make test-fast`

WORDS = [f"w{i}" for i in range(50)]
LONG = " ".join(WORDS[(i * 7) % 50] for i in range(260))  # ~530 tokens: several steps
# 90 % of LONG, then another ending: served by the other prefill instance (round robin),
# so its prefix can only come from the store
SIBLING = LONG[: int(len(LONG) * 0.9)] + " " + " ".join(WORDS[:20])
SHORT = "the quick brown fox"
REFERENCE: dict[str, object] = {}
ONE_STAGE_LAYERWISE: dict[str, object] = {}  # what the groups are compared with


def serve(tmp: Path, port: int, stages: int, layerwise: bool,
          tables: str = "") -> dict[str, object]:
    """``tables``: more TOML tables (e.g. ``[store.policy]``)."""
    cluster = start_cluster(tmp, http=port, base=port + 10, prefill=2, scheduler="round_robin",
                            extra=f"prefill_stages = {stages}\n"
                                  f"kv_layerwise = {str(layerwise).lower()}\n"
                                  "token_budget = 128\n" + tables)
    try:
        out: dict[str, object] = {}
        for name, prompt in (("long", LONG), ("sibling", SIBLING), ("short", SHORT)):
            r = httpx.post(cluster.url + "/v1/completions", timeout=120, json={
                "model": "smollm2-135m", "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            out[name] = body["choices"][0]["text"]
            out[name + "_cached"] = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            out[name + "_prompt"] = body["usage"]["prompt_tokens"]
            if name == "long":  # the sibling's prefix is in the store before it comes
                wait_index(cluster, out["long_prompt"] // cluster.config.block_size)
        metrics = httpx.get(cluster.url + "/metrics", timeout=5).text
        out["metrics"] = metrics
        wait_no_leaks(cluster)
        out["kv_bytes"] = kv_moved(cluster)
        out["paths"] = {}  # "flow/path" → bytes, every worker's
        for (_, flow, path), n in kv_bytes(conductor_metrics(cluster)).items():
            out["paths"][f"{flow}/{path}"] = out["paths"].get(f"{flow}/{path}", 0) + n
        out["loads_given_up"] = sum(
            s.value for family in text_string_to_metric_families(conductor_metrics(cluster))
            if family.name == "crescent_worker_dropped" for s in family.samples
            if s.labels["reason"] == "store_load")
        return out
    finally:
        cluster.stop()


def wait_index(cluster: LocalCluster, keys: int, timeout_s: float = 30.0) -> None:
    """Until the conductor's global index holds ``keys`` blocks: the store committed them
    and its events came (after the response: a store write may end after the stream)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = sum(s.value for family in text_string_to_metric_families(conductor_metrics(cluster))
                   if family.name == "crescent_conductor_global_index_keys"
                   for s in family.samples)
        if held >= keys:
            return
        assert time.monotonic() < deadline, f"the store holds {held} blocks, not {keys}"
        time.sleep(0.05)


def kv_moved(cluster: LocalCluster) -> float:
    """The KV bytes prefills moved to decode workers, as the conductor counted them (each
    ``PrefillDone``; a group's counts every stage's layers), checked equal to what the
    workers report in their heartbeats (``crescent_worker_kv_bytes``; a group's head
    reports its followers'), once the last heartbeats came."""
    told = sum(s.value for family in text_string_to_metric_families(conductor_metrics(cluster))
               if family.name == "crescent_conductor_kv_transfer_bytes"
               for s in family.samples if s.name.endswith("_total"))
    assert told > 0
    deadline = time.monotonic() + 10
    while True:
        reported = sum(n for (_, flow, _), n in kv_bytes(conductor_metrics(cluster)).items()
                       if flow == "decode")
        if reported == told or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert reported == told
    return told


def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One process per instance, whole-block store I/O: the code path before issue 12."""
    if not REFERENCE:
        REFERENCE.update(serve(tmp_path_factory.mktemp("ref"), 20800, 1, False))
    return REFERENCE


def one_stage_layerwise(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    if not ONE_STAGE_LAYERWISE:
        ONE_STAGE_LAYERWISE.update(serve(tmp_path_factory.mktemp("s1"), 20820, 1, True))
    return ONE_STAGE_LAYERWISE


# 3 stages has every role 2 has (a head, a follower that samples) and a middle one; groups
# of 2 give the reference's texts in the tests below and in the shared pipeline cluster's
@pytest.mark.parametrize("stages", [1, 3])
def test_same_greedy_outputs_with_any_group_size(tmp_path_factory, stages):
    ref = reference(tmp_path_factory)
    single = one_stage_layerwise(tmp_path_factory)
    got = single if stages == 1 else serve(tmp_path_factory.mktemp(f"s{stages}"),
                                           20820 + 20 * (stages - 1), stages, True)
    for name in ("long", "sibling", "short"):
        assert got[name] == ref[name], (name, stages)
    # the sibling's prefix came from the store (the other instance computed it)
    assert got["sibling_cached"] >= 0.8 * got["sibling_prompt"] - 16, got["sibling_cached"]
    assert got["sibling_cached"] == ref["sibling_cached"]
    assert got["kv_bytes"] == single["kv_bytes"]  # every stage's layers counted
    assert ref["kv_bytes"] == single["kv_bytes"]  # whole blocks: the cached prefix once


def test_a_failed_layer_wise_load_computes_the_prefix_instead(tmp_path_factory) -> None:
    """Every store lease ends before its first read can start, so the sibling's layer-wise
    load from the store fails: its prefix is computed instead (as a failed whole-block
    fetch is), with the reference's greedy text, nothing counted as cached, the give-up
    counted, and no block leaked (``serve``)."""
    ref = reference(tmp_path_factory)
    got = serve(tmp_path_factory.mktemp("lapsed"), 20880, 1, True,
                "[store.policy]\nlease_s = 0.0001\nmin_bytes_per_s = 1e15\n")
    for name in ("long", "sibling", "short"):
        assert got[name] == ref[name], name
    assert got["sibling_cached"] == 0 < ref["sibling_cached"]
    assert got["loads_given_up"] >= 1
    assert ref["loads_given_up"] == 0


def test_a_group_whose_store_load_failed_reruns_without_the_store(tmp_path_factory) -> None:
    """Three groups of 2 stages, store leases that end before any read: the sibling's group
    fails its load (a group cannot compute the prefix in place), and the conductor re-runs
    it once on the third group (round robin), which never saw the prefix. The re-run reads
    nothing from the store (``PrefillTask.store_loads``), so the same lapse cannot fail it
    again: the client gets the reference's greedy text, nothing cached, and no worker keeps
    a block. (Before, the re-run loaded again, failed again, and the client got a 503.)"""
    ref = reference(tmp_path_factory)
    cluster = start_cluster(tmp_path_factory.mktemp("group-lapsed"), http=22500, base=22510,
                            prefill=3, scheduler="round_robin",
                            extra="prefill_stages = 2\nkv_layerwise = true\ntoken_budget = 128\n"
                                  "[store.policy]\nlease_s = 0.0001\nmin_bytes_per_s = 1e15\n")
    try:
        # every group placeable first: round robin over three gives the re-run the third
        wait_for_instances(cluster, {"prefill-0", "prefill-1", "prefill-2"})
        got = {}
        for name, prompt in (("long", LONG), ("sibling", SIBLING)):
            r = httpx.post(cluster.url + "/v1/completions", timeout=120, json={
                "model": "smollm2-135m", "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            got[name] = r.json()
        for name in ("long", "sibling"):
            assert got[name]["choices"][0]["text"] == ref[name], name
        assert got["sibling"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        reruns = [line for line in conductor_metrics(cluster).splitlines()
                  if line.startswith("crescent_conductor_reruns_total ")]
        assert reruns == ["crescent_conductor_reruns_total 1.0"]
        wait_no_leaks(cluster)
    finally:
        cluster.stop()


def placements(metrics: str) -> dict[str, float]:
    """Requests placed per prefill instance (the conductor's counter)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("crescent_conductor_placed_total{"):
            labels, value = line.rsplit(" ", 1)
            prefill = labels.split('prefill="', 1)[1].split('"', 1)[0]
            out[prefill] = out.get(prefill, 0.0) + float(value)
    return out


def wait_for_instances(cluster, names: set[str], timeout_s: float = 60.0) -> None:
    """Until the conductor places on every one of ``names`` (registered, not draining)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = httpx.get(cluster.url + "/debug/pools", timeout=5).json()["instances"]
        if names <= {p["instance_id"] for p in pools if not p["draining"]}:
            return
        assert time.monotonic() < deadline, pools
        time.sleep(0.2)


def test_short_prompts_skip_the_pipeline(tmp_path_factory) -> None:
    """A mixed pool (a group of 2 stages and a single worker): the conductor predicts each
    instance's TTFT with its own shape's cost model, so a one-chunk prompt goes to the
    single worker and a long one to the group; outputs as with single workers only."""
    ref = reference(tmp_path_factory)
    cluster = start_cluster(tmp_path_factory.mktemp("mixed"), http=21600, base=21610,
                            prefill=2, scheduler="kvcache_centric",
                            extra="prefill_stages = 2\nprefill_groups = 1\ntoken_budget = 128\n")
    try:
        c = cluster.config
        assert [c.instance_id("prefill", i) for i in range(c.prefill_processes)] == [
            "prefill-0", "prefill-0.stage1", "prefill-1"]
        conductor = f"http://{c.address('conductor')}:{c.port('conductor_http')}/metrics"
        wait_for_instances(cluster, {"prefill-0", "prefill-1"})  # the cluster is up with one
        seen = []
        for name, prompt in (("short", SHORT), ("long", LONG)):
            r = httpx.post(cluster.url + "/v1/completions", timeout=120, json={
                "model": "smollm2-135m", "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ref[name], name
            seen.append(placements(httpx.get(conductor, timeout=5).text))
        assert seen[0] == {"prefill-1": 1.0}  # the short prompt: the single worker
        assert seen[1] == {"prefill-1": 1.0, "prefill-0": 1.0}  # the long one: the group
        wait_no_leaks(cluster)
    finally:
        cluster.stop()
