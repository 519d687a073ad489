"""GPU KV on one host (issue 26), on live clusters of 2 prefill workers, a decode worker and
a store node sharing one GPU: greedy outputs are the same whether KV goes through the
transfer engine's TCP loopback (``kv_path = "transfer_engine"``) or the same-host paths
(CUDA IPC to the decode worker, pinned memory to and from the store), layer by layer or
in whole blocks, including a prefix loaded from the store; and the bytes took the path
the config names. Needs ``CRESCENT_TEST_DEVICE=cuda`` (``benchmarks/gpu_device.sh``)."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import DEVICE
from tests.e2e.test_pipeline import serve

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.skipif(
    not DEVICE.startswith("cuda"), reason="GPU KV paths: set CRESCENT_TEST_DEVICE=cuda on a "
    "machine with a CUDA GPU")]

TCP = 'kv_path = "transfer_engine"\n'


def test_same_greedy_outputs_over_tcp_cuda_ipc_and_pinned_memory(tmp_path_factory) -> None:
    tcp = serve(tmp_path_factory.mktemp("tcp"), 20900, 1, False, TCP)
    layerwise = serve(tmp_path_factory.mktemp("lw"), 20920, 1, True)
    after = serve(tmp_path_factory.mktemp("after"), 20940, 1, False)
    for got in (layerwise, after):
        for name in ("long", "sibling", "short"):
            assert got[name] == tcp[name], name
        assert got["sibling_cached"] == tcp["sibling_cached"] > 0
        paths = got["paths"]
        assert paths.get("decode/cuda_ipc", 0) > 0 and not paths.get("decode/transfer_engine")
        assert paths.get("store_write/pinned", 0) > 0 and paths.get("store_read/pinned", 0) > 0
        assert not paths.get("store_write/transfer_engine")
    assert tcp["paths"].get("decode/transfer_engine", 0) > 0
    assert not tcp["paths"].get("decode/cuda_ipc")
