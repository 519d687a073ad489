"""SLO admission end to end: a request that cannot meet its TTFT SLO is rejected before
any work is done, with 429 and Retry-After, and nothing is left behind."""
from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from launch.cluster import LocalCluster
from tests.e2e.conftest import start_cluster, wait_no_leaks

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("strict"), http=19430, base=19800, store=False,
                      scheduler="kvcache_centric", ttft_slo_s=0.000001)
    yield c
    c.stop()


def test_unmeetable_ttft_slo_is_429_with_retry_after(strict: LocalCluster) -> None:
    r = httpx.post(strict.url + "/v1/chat/completions", timeout=30, json={
        "model": "smollm2-135m", "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "ttft_slo" and "predicted TTFT" in err["message"]
    pools = wait_no_leaks(strict)
    assert all(p["assigned"] == 0 for p in pools)
