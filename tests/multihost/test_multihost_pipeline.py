"""A pipelined prefill group split over two hosts (stage 0 on h2, stage 1 on h3, decode on
h1): the same greedy answers as one host without a pipeline; hidden states and KV cross
hosts through the transfer engine, never shared memory."""
from __future__ import annotations

from typing import Iterator

import pytest

from benchmarks.fault_load import reference_answers
from launch.multihost import NetnsCluster
from launch.netns import TestBed
from tests.multihost.conftest import (
    H1, H2, H3, MAX_TOKENS, PIPELINE_HTTP, QUESTIONS, kv_bytes, wait_metrics, write_config,
)

pytestmark = pytest.mark.e2e
HOSTS = {"router": H1, "conductor": H1, "store_master": H1, "prefill": [H2, H3],
         "decode": [H1], "store_node": [H2, H3]}


@pytest.fixture(scope="module")
def pipelined(bed: TestBed, single_host: dict,  # noqa: ARG001 (after the reference)
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    tmp = tmp_path_factory.mktemp("pipeline")
    cluster = NetnsCluster(write_config(tmp / "cluster.toml", PIPELINE_HTTP, 1, 2, HOSTS,
                                        stages=2), tmp / "logs", bed)
    with cluster:
        yield cluster


def test_a_pipeline_over_two_hosts_answers_as_one_host(pipelined: NetnsCluster,
                                                        single_host: dict) -> None:
    assert (pipelined.host("prefill", 0), pipelined.host("prefill", 1)) == ("h2", "h3")
    answers = pipelined.call(reference_answers, pipelined.url, QUESTIONS, MAX_TOKENS)
    assert answers == single_host["answers"]
    key = ("prefill-0", "hidden", "transfer_engine")
    moved = kv_bytes(wait_metrics(pipelined, lambda t: kv_bytes(t).get(key, 0) > 0))
    assert moved.get(("prefill-0", "hidden", "shm"), 0) == 0
    assert moved[("prefill-0", "decode", "transfer_engine")] > 0
    assert moved.get(("prefill-0", "decode", "shm"), 0) == 0
