"""One config object for the whole cluster: sizes, ports, timeouts, policy.

The socket topology is written down here once: every process binds one PULL inbox at
``inbox(role, index)``; nothing else binds except the router's HTTP port and the store.
A TOML file (``crescent up --config FILE``) overrides any field; see launch/configs/.
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from common.cpu import CpuConfig


@dataclass
class SLOConfig:
    ttft_s: float = 30.0
    tbt_s: float = 0.3


@dataclass
class ClusterConfig:
    model: str = "smollm2-135m"
    served_model_name: Optional[str] = None  # name in /v1/models; default: the model's name
    dtype: str = "float32"
    # Compute dtype of prefill workers (None: ``dtype``). Disaggregation lets each phase run
    # the precision that pays for it: on a CPU with AVX-512 BF16, bfloat16 prefill is ~1.35x
    # faster while bfloat16 decode is slower. The KV dtype stays the cluster's one.
    prefill_dtype: Optional[str] = None
    kv_dtype: str = "auto"  # paged KV storage: auto (= dtype) | float32 | bfloat16 | float16
    kv_path: str = "auto"  # prefill → decode KV: auto (shm on one host) | shm | transfer_engine
    device: str = "cpu"
    host: str = "127.0.0.1"
    http_port: int = 8000
    base_port: int = 7500  # inbox ports are allocated from here; see inbox()
    prefill_workers: int = 1
    decode_workers: int = 1
    store_nodes: int = 1
    use_store: bool = True
    block_size: int = 16
    prefill_blocks: int = 1024
    decode_blocks: int = 2048
    prefill_chunk: int = 512
    # "disaggregated": prefill and decode pools; "colocated": colocated_workers workers that
    # each prefill and decode in the same steps (the in-project baseline; one small box).
    mode: str = "disaggregated"
    colocated_workers: int = 1
    # Tokens per engine step: a prefill worker's batch of prompt chunks, or a colocated
    # step (its decodes + prompt chunks). None: 256 for a prefill worker; 128 for a
    # colocated worker, whose every step is also a decode step: Sarathi sizes the budget
    # from the TBT SLO, but on a CPU small chunks waste weight reads (64 halved its prefill
    # throughput on 2 cores and doubled TTFT; benchmarks/live_replay.py, BENCHMARKS.md).
    token_budget: Optional[int] = None
    max_batch_size: int = 64
    max_queue: int = 256  # admission: requests waiting for prefill, cluster-wide
    default_max_tokens: int = 256
    scheduler: str = "load_balance"  # random | round_robin | load_balance | local_cache_aware | kvcache_centric
    admission: str = "early"  # none | early | predicted
    expected_decode_s: float = 10.0  # "predicted": typical decode time until 32 decodes finished
    kvcache_balancing_threshold: float = 2.0
    cost_profile: str = "cpu-smollm2-135m"  # a named profile or a coefficients JSON file
    slo: SLOConfig = field(default_factory=SLOConfig)
    transfer_protocol: str = "tcp"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    kv_wait_timeout_s: float = 60.0  # decode frees reserved blocks if KV has not landed
    request_timeout_s: float = 600.0  # router gives up on a silent request
    store_segment_bytes: int = 256 << 20
    store_ssd_bytes: int = 0
    store_ssd_dir: Optional[str] = None
    cpu: CpuConfig = field(default_factory=CpuConfig)  # [cpu]: per-role cores, threads

    def step_budget(self, role: str) -> int:
        if self.token_budget is not None:
            return max(1, self.token_budget)
        return 128 if role == "colocated" else 256

    # --------------------------------------------------------------- topology
    def inbox(self, role: str, index: int = 0) -> str:
        """The PULL address of a process. Ports: router, conductor, store master, then
        prefill workers, decode workers and store nodes in order."""
        offsets = {"router": 0, "conductor": 1, "store_master": 2}
        if role in offsets:
            port = self.base_port + offsets[role]
        elif role == "prefill":
            port = self.base_port + 10 + index
        elif role == "decode":
            port = self.base_port + 10 + self.prefill_workers + index
        elif role == "store_node":
            port = self.base_port + 10 + self.prefill_workers + self.decode_workers + index
        elif role == "colocated":
            port = (self.base_port + 10 + self.prefill_workers + self.decode_workers
                    + self.store_nodes + index)
        else:
            raise ValueError(f"unknown role {role!r}")
        return f"tcp://{self.host}:{port}"

    @property
    def store_events_address(self) -> str:
        """The store master's PUB socket of KV events (the conductor subscribes)."""
        return f"tcp://{self.host}:{self.base_port + 5}"

    def instance_id(self, role: str, index: int) -> str:
        return f"{role}-{index}"

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).stem if "/" in self.model else self.model

    # --------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ClusterConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        data = dict(data)
        if "slo" in data:
            data["slo"] = SLOConfig(**data["slo"])
        if "cpu" in data:
            data["cpu"] = CpuConfig(**data["cpu"])
        if data.get("prefill_dtype") not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"prefill_dtype must be float32, bfloat16 or float16, not "
                             f"{data['prefill_dtype']!r}")
        if data.get("mode", "disaggregated") not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', not {data['mode']!r}")
        return cls(**data)

    @classmethod
    def load(cls, path: Optional[str]) -> "ClusterConfig":
        if not path:
            return cls()
        with open(path, "rb") as fh:
            return cls.from_dict(tomllib.load(fh))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
