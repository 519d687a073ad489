"""Hidden states between pipeline stages (services/prefill/hidden.py): exact bytes over shared
memory and over the real transfer engine, bounds, deadlines, files, the route on the wire."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import socket
import subprocess
import sys
import time
from typing import Iterator, Optional

import pytest
import torch

from common.host import host_id
from common.ipc import ProtocolError, decode, encode, message
from services.prefill.hidden import HiddenInbox, HiddenRoute, HiddenSender
from common.transfer import TransferError

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
SLOTS, SLOT_BYTES = 3, 64 * 1024
_IDS = itertools.count()


@pytest.fixture
def inbox(agents) -> Iterator[HiddenInbox]:
    box = HiddenInbox(agents[1], f"test-{next(_IDS)}", SLOTS, SLOT_BYTES)
    yield box
    box.close()


def sender(agents, route: HiddenRoute, mode: str) -> HiddenSender:
    return HiddenSender(agents[0], route, mode, host_id())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["auto", "shm", "transfer_engine"])
def test_a_tensor_arrives_byte_for_byte_in_its_slot_only(agents, inbox, mode, dtype) -> None:
    s = sender(agents, inbox.route, mode)
    try:
        assert s.path == ("transfer_engine" if mode == "transfer_engine" else "shm")
        x = torch.randn(97, 80, generator=torch.Generator().manual_seed(3)).to(dtype)
        assert s.send(1, x, timeout_s=5) == 97 * 80 * x.element_size()
        got = inbox.read(1, 97, 80, dtype)
        assert got.dtype == dtype and got.shape == (97, 80)
        assert torch.equal(got.view(torch.uint8), x.view(torch.uint8))  # bits, NaNs too
        for other in (0, 2):
            assert inbox.read(other, 97, 80, dtype).abs().sum() == 0
        y = x.t()  # not contiguous: its values in row-major order arrive
        s.send(2, y, timeout_s=5)
        assert torch.equal(inbox.read(2, 80, 97, dtype), y)
        s.send(1, -x, timeout_s=5)
        assert torch.equal(got, x)  # read returned a copy: refilling the slot left it
        assert torch.equal(inbox.read(1, 97, 80, dtype), -x)
        out = torch.empty(97, 80, dtype=dtype)
        assert inbox.read(1, 97, 80, dtype, out=out) is out and torch.equal(out, -x)
        with pytest.raises(ValueError, match=r"out is \(80, 97\)"):
            inbox.read(1, 97, 80, dtype, out=out.t())
    finally:
        s.close()


def test_the_staging_buffer_grows_for_bigger_tensors(agents, inbox) -> None:
    s = sender(agents, inbox.route, "transfer_engine")
    try:
        small, full = torch.arange(8.0).view(2, 4), torch.rand(SLOT_BYTES // 4 // 16, 16)
        s.send(0, small, 5)
        assert s._staging.numel() == 32
        s.send(2, full, 5)
        assert s._staging.numel() == SLOT_BYTES
        s.send(1, small + 1, 5)
        assert torch.equal(inbox.read(2, *full.shape, torch.float32), full)
        assert torch.equal(inbox.read(0, 2, 4, torch.float32), small)
        assert torch.equal(inbox.read(1, 2, 4, torch.float32), small + 1)
    finally:
        s.close()
    assert s._staging.numel() == 0


@pytest.mark.parametrize("mode", ["shm", "transfer_engine"])
def test_bad_slots_sizes_and_dtypes_are_refused(agents, inbox, mode) -> None:
    s = sender(agents, inbox.route, mode)
    try:
        ok = torch.zeros(4, 4)
        for slot in (-1, SLOTS, True, 1.0):
            with pytest.raises(ValueError, match="outside"):
                s.send(slot, ok, 5)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="outside"):
                inbox.read(slot, 4, 4, torch.float32)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"65540 bytes: not in \\(0, {SLOT_BYTES}\\]"):
            s.send(0, torch.zeros(SLOT_BYTES // 4 + 1), 5)
        with pytest.raises(ValueError, match="0 bytes"):
            s.send(0, torch.zeros(0, 16), 5)
        with pytest.raises(ValueError, match="hidden states must be one of"):
            s.send(0, torch.zeros(4, 4, dtype=torch.int64), 5)
        with pytest.raises(ValueError, match="timeout_s must be positive"):
            s.send(0, ok, 0)
        with pytest.raises(ValueError, match="does not fit"):
            inbox.read(0, 129, 128, torch.float32)
        with pytest.raises(ValueError, match="hidden states must be one of"):
            inbox.read(0, 4, 4, torch.int32)
        assert inbox.read(0, 128, 256, torch.bfloat16).numel() == SLOT_BYTES // 2  # exact fit
        with pytest.raises(ValueError, match="mode must be one of"):
            HiddenSender(agents[0], inbox.route, "tcp", host_id())
    finally:
        s.close()
    with pytest.raises(ValueError, match="closed"):
        s.send(0, ok, 5)


def test_a_route_to_an_unknown_session_fails_fast(agents, inbox) -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there
    route = dataclasses.replace(inbox.route, session_id=f"127.0.0.1:{port}")
    s = sender(agents, route, "transfer_engine")
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="failed"):
            s.send(0, torch.ones(16, 16), timeout_s=5)
        assert time.monotonic() - t0 < 2
    finally:
        s.close()


@pytest.fixture
def silent() -> Iterator[socket.socket]:
    """A peer that accepts the connection and never answers the handshake."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    yield sock
    sock.close()


def test_a_silent_peer_costs_the_deadline_and_holds_the_sender_until_it_returns(
        agents, inbox, silent, caplog) -> None:
    target = f"127.0.0.1:{silent.getsockname()[1]}"
    s = sender(agents, dataclasses.replace(inbox.route, session_id=target), "transfer_engine")
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="missed its 0.3s deadline"):
            s.send(0, torch.ones(16, 16), timeout_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 1.5
        [hung] = agents[0].in_flight(target)
        with pytest.raises(TransferError, match="still running"):  # at once
            s.send(0, torch.ones(16, 16), timeout_s=5)
        silent.close()  # the native call now fails
        with pytest.raises(TransferError):
            hung.result(10)
        with pytest.raises(TransferError, match="failed"):
            s.send(0, torch.ones(16, 16), timeout_s=5)
        gc.collect()  # the late outcome of the hung call was dropped, not left unretrieved
        assert "never retrieved" not in caplog.text
    finally:
        s.close()


def test_closing_during_a_hung_write_keeps_its_buffer_until_it_returns(agents, inbox,
                                                                      silent) -> None:
    target = f"127.0.0.1:{silent.getsockname()[1]}"
    s = sender(agents, dataclasses.replace(inbox.route, session_id=target), "transfer_engine")
    with pytest.raises(TransferError, match="deadline"):
        s.send(0, torch.ones(16, 16), timeout_s=0.2)
    staging = s._staging.data_ptr()
    s.close()
    assert staging in agents[0]._registered  # the native call still reads from it
    [hung] = agents[0].in_flight(target)
    silent.close()
    with pytest.raises(TransferError):
        hung.result(10)
    deadline = time.monotonic() + 5  # its done callbacks run just after result() returns
    while staging in agents[0]._registered and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging not in agents[0]._registered


def test_the_file_is_a_hidden_segment_and_is_unlinked_on_close(agents) -> None:
    box = HiddenInbox(agents[1], "stage-1", 2, 4096)
    path = box.route.shm_path
    assert path == f"/dev/shm/crescent-hidden-{socket.gethostname()}-stage-1-{os.getpid()}"
    assert os.path.getsize(path) == 2 * 4096
    assert box.route == HiddenRoute(host_id(), path, agents[1].session_id, box.segment.base,
                                    2, 4096)
    box.close()
    assert not os.path.exists(path)
    box.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        box.read(0, 1, 1, torch.float32)
    with pytest.raises(ValueError, match="owner"):
        HiddenInbox(agents[1], "../etc", 2, 4096)


def test_a_dead_process_s_inbox_file_is_swept_by_the_next_inbox(agents) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = f"/dev/shm/crescent-hidden-{socket.gethostname()}-stage-0-{proc.pid}"
    open(stale, "wb").close()
    box = HiddenInbox(agents[1], "stage-0", 1, 4096)
    try:
        assert not os.path.exists(stale) and os.path.exists(box.route.shm_path)
    finally:
        box.close()


def test_without_dev_shm_the_inbox_is_private_and_the_transfer_engine_carries(
        agents, tmp_path) -> None:
    box = HiddenInbox(agents[1], "private", 2, 4096, shm_dir=str(tmp_path / "missing"))
    s = sender(agents, box.route, "shm")
    try:
        assert box.route.shm_path is None and s.path == "transfer_engine"
        x = torch.randn(8, 16)
        s.send(1, x, 5)
        assert torch.equal(box.read(1, 8, 16, torch.float32), x)
    finally:
        s.close()
        box.close()


def test_the_path_follows_the_mode_and_the_host(agents, inbox, caplog) -> None:
    elsewhere = dataclasses.replace(inbox.route, host_id="other-host/boot")
    chosen = {}
    for mode, route in [("auto", elsewhere), ("shm", elsewhere), ("auto", inbox.route)]:
        s = sender(agents, route, mode)
        chosen[mode, route.host_id] = s.path
        s.close()
    assert chosen == {("auto", "other-host/boot"): "transfer_engine",
                      ("shm", "other-host/boot"): "shm", ("auto", host_id()): "shm"}
    kv_named = f"/dev/shm/crescent-kv-{socket.gethostname()}-x-{os.getpid()}"
    for path in ("/etc/passwd", kv_named, inbox.route.shm_path.rsplit("-", 1)[0] + "-999999999"):
        s = sender(agents, dataclasses.replace(inbox.route, shm_path=path), "shm")
        assert s.path == "transfer_engine"  # never mapped: a file of someone else's kind
        s.send(0, torch.ones(2, 2), 5)  # and the engine still reaches the inbox
        s.close()
    assert caplog.text.count("using the transfer engine") == 3


@message
class _HiddenHop:
    """Only for this test: a control message carrying routes."""

    route: HiddenRoute
    next_route: Optional[HiddenRoute]


def test_a_route_rides_in_a_control_message(inbox) -> None:
    msg = _HiddenHop(inbox.route, dataclasses.replace(inbox.route, shm_path=None))
    back = decode(encode(msg))
    assert back == msg and isinstance(back.route, HiddenRoute)
    assert back.next_route.shm_path is None
    assert decode(encode(_HiddenHop(inbox.route, None))).next_route is None
    good = encode(msg).decode()
    with pytest.raises(ProtocolError, match="_HiddenHop.route is invalid: bad hidden route"):
        decode(good.replace(f'"slots":{SLOTS}', '"slots":0', 1).encode())
    with pytest.raises(ProtocolError, match="_HiddenHop.route.base has the wrong type"):
        decode(good.replace('"base":', '"base":"x","was":', 1).encode())
    with pytest.raises(ValueError, match="needs a host_id"):
        HiddenRoute("", None, "127.0.0.1:1", 0, 1, 1)
