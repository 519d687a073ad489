"""One config object for the whole cluster: sizes, ports, timeouts, policy.

The socket topology is written down once, in common/config_topology.py (``inbox``,
``port``): every process binds one inbox at ``inbox(role, index)``; the only other bound
ports are the fixed ones in ``FIXED_PORTS``. Every process has one advertised address, ``address(role, index)`` (the
``[hosts]`` table, else ``host``), and binds its listeners there, or on ``bind_host`` when
set (docs/multihost.md). A TOML file (``crescent up --config FILE``) overrides any field, and
``--set key=value`` one field of one process (common/service.py); see launch/configs/ and,
for how tables become this object, common/config_load.py.
"""
from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from common.config_hosts import INDEXED_ROLES, HostsConfig, is_address
from common.config_load import from_tables, merge
from common.config_topology import Topology
from common.cpu import CpuConfig
from common.kv.dtypes import resolve_kv_dtype
from common.security import SecurityConfig
from common.store.policy import MetadataConfig

REASONING_PARSERS = ("qwen3", "deepseek_r1")  # services/router/reasoning.py
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0")  # common/model/quant.py
LORA_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")  # a LoRA adapter's served name



@dataclass
class SLOConfig:
    ttft_s: float = 30.0
    tbt_s: float = 0.3


@dataclass
class StoreConfig:
    """The ``[store]`` table: the global KV pool's nodes and its master's policy. Every
    store setting lives here; the store services read nothing else."""

    enabled: bool = True
    nodes: int = 1
    segment_bytes: int = 256 << 20  # DRAM segment of each node
    ssd_bytes: int = 0  # SSD tier of each node (0: none)
    ssd_dir: Optional[str] = None  # node i uses <ssd_dir>/node-<i>
    shm_dir: Optional[str] = "/dev/shm"  # segment file (None: anonymous, transfer engine only)
    heartbeat_interval_s: float = 0.5  # the master tells nodes to beat this often
    register_deadline_s: float = 10.0  # a node exits if the master is unreachable this long
    node_timeout_s: float = 2.0  # one register exchange of a node
    promote_wait_s: float = 2.0  # a get waits this long for SSD → DRAM promotions
    tick_s: float = 0.1  # the master's reaper period
    policy: MetadataConfig = field(default_factory=MetadataConfig)  # [store.policy]


@dataclass
class SuperviseConfig:
    """The ``[supervise]`` table: how ``crescent up`` restarts a child that exits on its
    own (launch/supervise.py), and how long a process drains on SIGTERM (common/service.py)."""

    restart: bool = True  # False: one child's exit stops the cluster
    backoff_s: float = 0.5  # delay before a restart; doubles per restart in the last minute
    max_backoff_s: float = 10.0
    max_restarts_per_minute: int = 5  # per child; one more exit stops the cluster
    drain_timeout_s: float = 10.0  # SIGTERM: finish in-flight work this long, then exit

    def __post_init__(self) -> None:
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError("[supervise] needs 0 <= backoff_s <= max_backoff_s")
        if self.max_restarts_per_minute < 1 or self.drain_timeout_s < 0:
            raise ValueError("[supervise] needs max_restarts_per_minute >= 1 and "
                             "drain_timeout_s >= 0")


def default_layerwise(device: str, transfer_protocol: str, prefill_stages: int,
                      kv_path: str = "auto") -> bool:
    """``kv_layerwise`` when a config leaves it out: true, except for GPU KV that only the
    transfer engine over TCP moves (``kv_path = "transfer_engine"``): there whole blocks
    after the prefill reached the first token 2.5-3.2x sooner than layer-wise on an H200
    (BENCHMARKS.md, "GPU"). On one host (CUDA IPC to the decode worker, the store's
    segments pinned) a GPU's layer-wise I/O moves a chunk's blocks at once after the chunk
    and loads a stored prefix per layer behind the compute (BENCHMARKS.md, "GPU KV on one
    host"); across hosts over TCP it streams per layer. A pipeline is always layer-wise."""
    gpu_tcp_only = (str(device).startswith("cuda") and transfer_protocol == "tcp"
                    and kv_path == "transfer_engine")
    return not gpu_tcp_only or prefill_stages > 1


@dataclass
class ClusterConfig(Topology):
    model: str = "smollm2-135m"
    served_model_name: Optional[str] = None  # name in /v1/models; default: the model's name
    # [lora_modules]: LoRA adapters served beside the model, name = "PEFT directory" or
    # "llama.cpp GGUF adapter" (as vLLM's --lora-modules): a request whose ``model`` is a
    # name runs on that adapter (common/model/lora.py). Every worker loads every adapter
    # at start.
    lora_modules: dict[str, str] = field(default_factory=dict)
    dtype: str = "float32"
    # Compute dtype of prefill workers (None: ``dtype``; "auto": bfloat16 where the CPU has
    # AVX-512 BF16 or AMX, ~1.35x faster there, ~7x slower on AVX2: common/worker.py;
    # "int8": float32, the linears of a quantized model in int8, as ``linear_dtype``). The
    # KV dtype stays the cluster's one.
    prefill_dtype: Optional[str] = None
    # The dtype a decode or colocated worker's linears multiply in (weights stored in it;
    # norms, attention, residual in ``dtype``). None: ``dtype``. "auto": bfloat16 where the
    # CPU computes it natively and dtype is float32 (common/model/linear.py Linear).
    # "int8": a quantized model's codes times its inputs rounded to int8 per group, as
    # llama.cpp multiplies (csrc/linear_int8.c, where AVX-512 VNNI is; float matrices
    # multiply in float32): the fastest, other answers (docs/models.md)
    linear_dtype: Optional[str] = None
    # A model's quantized linears (common/model/quant.py; decode CPU steps of the default
    # model: BENCHMARKS.md, "Quantized linears"): "auto" keeps a GGUF's Q4_0 ... Q6_K
    # matrices as the file holds them on a float32 CPU worker whose CPU runs the kernel
    # (the same float32 results, a fraction of the bytes), else expands them; "none"
    # always expands them; "q8_0" or "q4_0" quantizes a float checkpoint's (an HF
    # directory, a dummy model) at load, as llama.cpp rounds it
    quantization: str = "auto"
    kv_dtype: str = "auto"  # paged KV storage: auto (= dtype) | float32 | bfloat16 | float16
    kv_path: str = "auto"  # prefill → decode KV: auto (shm on one host) | shm | transfer_engine
    device: str = "cpu"
    host: str = "127.0.0.1"  # the address of every process [hosts] does not name
    bind_host: str = ""  # listeners bind here (e.g. "0.0.0.0" in a pod); "": own address
    hosts: HostsConfig = field(default_factory=HostsConfig)  # [hosts]: per-process addresses
    http_port: int = 8000
    base_port: int = 7500  # inbox ports are allocated from here; see inbox()
    # GET /health of every process (common/health.py), GET /metrics of every worker and store
    # node (common/worker_metrics.py; router, conductor, master: their own): port + n, n
    # counting the processes before it at its address. None: no such listeners.
    health_port: Optional[int] = None
    metrics_port: Optional[int] = None
    # router processes, all serving ``http_port`` (SO_REUSEPORT: the kernel spreads the
    # connections); one streams ~16-27k tokens/s (docs/deploy.md)
    routers: int = 1
    prefill_workers: int = 1  # prefill instances (with prefill_stages > 1: groups)
    prefill_stages: int = 1  # processes per prefill instance, layers split (group.py); 1: none
    # How many of the prefill instances are such groups (the first ones); the others are
    # single workers that hold every layer. None: all of them. A mixed pool lets short
    # prompts skip the pipeline: the conductor predicts each instance's TTFT with its own
    # shape's cost model, and one chunk gains nothing from passing through stages.
    prefill_groups: Optional[int] = None
    # Layer-wise KV I/O: a prompt's new blocks go to the store layer by layer as they are
    # computed, a cached prefix loads from it layer by layer while the rest computes, and
    # KV streams to the decode worker per layer. False: whole blocks after (to the decode
    # worker and the store) and before the prefill (from the store): the baseline. None:
    # ``default_layerwise`` (true but for GPU KV over TCP alone): readers see a bool.
    kv_layerwise: Optional[bool] = None
    decode_workers: int = 1
    block_size: int = 16
    prefill_blocks: int = 1024
    decode_blocks: int = 2048
    mode: str = "disaggregated"  # or "colocated": workers that prefill and decode in one step
    colocated_workers: int = 1
    # Tokens per engine step: a prefill worker's batch of prompt chunks, or a colocated
    # step (its decodes + prompt chunks). None: 256 for a prefill worker; 128 for a
    # colocated worker, every step of which also decodes (Sarathi sizes it from the TBT SLO;
    # on a CPU 64 halved prefill throughput on 2 cores and doubled TTFT: BENCHMARKS.md).
    token_budget: Optional[int] = None
    # A greedy answer that does not depend on the load (on the CPU): chunks end at block
    # boundaries (common/engine/batching.py) and attend in parts there unless the CPU kernel
    # computes each row alone anyway. false: they end anywhere and attend whole (answers
    # may then depend on the load; without the kernel 9-19 % less prefill compute).
    batch_invariant: bool = True
    # A prefill worker's order (services/prefill/queue.py): "shortest" (fewest tokens left
    # first; one that waited prefill_max_wait_s, default kv_wait_timeout_s / 2, first), "arrival"
    # A prompt of at most prefill_preempt_tokens to compute arriving while a prefill step
    # computes runs at that step's next layer boundary, not after it (0: never; preempt.py),
    # unless a prompt there has waited prefill_preempt_backlog_s (None: any wait; README)
    prefill_order: str = "shortest"
    prefill_max_wait_s: Optional[float] = None
    prefill_preempt_tokens: int = 128
    prefill_preempt_backlog_s: Optional[float] = None
    prefill_graph_tokens: int = 0  # GPU prompt steps of up to this many tokens: CUDA graphs
    max_batch_size: int = 64
    max_queue: int = 256  # admission: requests waiting for prefill, cluster-wide
    default_max_tokens: int = 256
    # A thinking model's answers: "qwen3" or "deepseek_r1" split its <think> block into the
    # chat message's reasoning_content (services/router/reasoning.py); None: all content
    reasoning_parser: Optional[str] = None
    scheduler: str = "load_balance"  # random | round_robin | load_balance | local_cache_aware | kvcache_centric
    admission: str = "early"  # none | early | predicted
    expected_decode_s: float = 10.0  # "predicted": typical decode time until 32 decodes finished
    kvcache_balancing_threshold: float = 2.0
    # "auto": each worker's phases fitted on its machine at its first start there (cached;
    # common/engine/calibrate.py), refitted online; or a named profile or a JSON file
    cost_profile: str = "auto"
    # What the scheduler assumes a prefix moves at from the store to a prefill worker
    # (bytes/s). None: learned from the prefills' loads (services/conductor/calibration.py
    # ReadBandwidth), the cost profile's (1e9 for the shipped one) until then. TCP moved
    # 1.4-1.6e9 from an H200's memory; RDMA is far more (the paper's profiles: 87e9).
    transfer_bandwidth_bytes_per_s: Optional[float] = None
    slo: SLOConfig = field(default_factory=SLOConfig)
    transfer_protocol: str = "tcp"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    kv_wait_timeout_s: float = 60.0  # decode frees reserved blocks if KV has not landed
    request_timeout_s: float = 600.0  # router gives up on a silent request
    # A request that finds no live prefill or decode worker (at submission, or re-run after
    # its prefill worker died) waits this long for one (a restart), then fails (503); 0: at once.
    worker_wait_s: float = 30.0
    store: StoreConfig = field(default_factory=StoreConfig)  # [store]: the global KV pool
    cpu: CpuConfig = field(default_factory=CpuConfig)  # [cpu]: per-role cores, threads
    security: SecurityConfig = field(default_factory=SecurityConfig)  # [security]: keys
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)  # [supervise]

    def __post_init__(self) -> None:
        """Every check and derived default, however the config is made (``from_dict``, a
        TOML file, or ``ClusterConfig(...)`` in code)."""
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not "
                             f"{self.quantization!r}")
        self._check_lora_modules()
        if self.prefill_dtype not in (None, "auto", "float32", "bfloat16", "float16", "int8"):
            raise ValueError("prefill_dtype must be auto, float32, bfloat16, float16 or int8, "
                             f"not {self.prefill_dtype!r}")
        if self.linear_dtype not in (None, "auto", "float32", "bfloat16", "float16", "int8"):
            raise ValueError("linear_dtype must be auto, float32, bfloat16, float16 or int8, "
                             f"not {self.linear_dtype!r}")
        if not isinstance(self.routers, int) or isinstance(self.routers, bool) \
                or self.routers < 1:
            raise ValueError(f"routers must be a positive integer, not {self.routers!r}")
        if not isinstance(self.prefill_stages, int) or self.prefill_stages < 1:
            raise ValueError(f"prefill_stages must be a positive integer, not {self.prefill_stages!r}")
        groups = self.prefill_groups
        if groups is not None and (not isinstance(groups, int) or not
                                   0 <= groups <= self.prefill_workers):
            raise ValueError(f"prefill_groups must be an integer from 0 to prefill_workers "
                             f"({self.prefill_workers}), not {groups!r}")
        if groups and self.prefill_stages == 1:
            raise ValueError("prefill_groups needs prefill_stages > 1 (the processes per group)")
        if self.prefill_stages > 1 and groups != 0 and self.kv_layerwise is False:
            raise ValueError("prefill_stages > 1 needs kv_layerwise = true: each stage moves "
                             "its own layers of a block, so store I/O is layer-wise")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or unset, "
                             f"not {self.reasoning_parser!r}")
        if not self.worker_wait_s >= 0:
            raise ValueError(f"worker_wait_s must be >= 0, not {self.worker_wait_s!r}")
        if self.prefill_max_wait_s is None:
            self.prefill_max_wait_s = self.kv_wait_timeout_s / 2
        counts = (self.prefill_preempt_tokens, self.prefill_graph_tokens)
        if self.prefill_order not in ("shortest", "arrival") or not self.prefill_max_wait_s > 0 \
                or not all(isinstance(n, int) and n >= 0 for n in counts) \
                or not (self.prefill_preempt_backlog_s is None or self.prefill_preempt_backlog_s > 0):
            raise ValueError("prefill_order must be 'shortest' or 'arrival', prefill_max_wait_s "
                             "and prefill_preempt_backlog_s > 0, prefill_preempt_tokens and "
                             f"prefill_graph_tokens >= 0, not {self.prefill_order!r}, "
                             f"{self.prefill_max_wait_s!r}, {self.prefill_preempt_backlog_s!r}, "
                             f"{counts[0]!r}, {counts[1]!r}")
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', not {self.mode!r}")
        if self.kv_layerwise is None:
            self.kv_layerwise = default_layerwise(self.device, self.transfer_protocol,
                                                  self.prefill_stages, self.kv_path)
        if not is_address(self.host):
            raise ValueError(f"host must be an address (a non-empty string), not {self.host!r}")
        if not isinstance(self.bind_host, str) or self.bind_host != self.bind_host.strip():
            raise ValueError(f"bind_host must be an address or \"\", not {self.bind_host!r}")
        for role in (*INDEXED_ROLES, "router"):
            hosts = getattr(self.hosts, role)
            if not isinstance(hosts, list):
                continue
            listed, count = len(hosts), self.processes(role)
            if listed > count:
                raise ValueError(f"[hosts] {role} lists {listed} addresses but the cluster "
                                 f"has {count} {role} process(es): index {count} and up "
                                 f"do not exist")
        self.kv_storage_dtype  # an unknown kv_dtype fails the config, not a worker's start

    @property
    def kv_storage_dtype(self) -> str:
        """The dtype every worker's paged KV is stored in (``kv_dtype``; ``auto``: the
        decode dtype), and the one the router's block keys name: resolved here only."""
        return resolve_kv_dtype(self.dtype, self.kv_dtype)

    def step_budget(self, role: str) -> int:
        if self.token_budget is not None:
            return max(1, self.token_budget)
        return 128 if role == "colocated" else 256

    def chunk_align(self) -> int:
        """With ``batch_invariant`` on the CPU: where prompt chunks may end (a multiple of
        this many tokens, or the prompt's end) and where they are cut into attention
        parts: the block size, where a cached prefix ends too. 0: anywhere (and on a GPU,
        whose kernels batch invariance does not cover: parts would cost launches)."""
        return self.block_size if self.batch_invariant and self.device == "cpu" else 0

    def _check_lora_modules(self) -> None:
        modules = self.lora_modules
        if not isinstance(modules, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in modules.items()):
            raise ValueError("[lora_modules] must map adapter names to directories "
                             f"(name = \"path\"), not {modules!r}")
        for name in modules:
            if not LORA_NAME.fullmatch(name) or name == self.model_name:
                raise ValueError(f"LoRA adapter name {name!r}: 1-128 letters, digits and "
                                 "._:/- , other than the served model's name "
                                 f"{self.model_name!r}")

    @property
    def served_names(self) -> tuple[str, ...]:
        """What a request's ``model`` may name: the model, then its LoRA adapters."""
        return (self.model_name, *self.lora_modules)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).stem if "/" in self.model else self.model

    # --------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ClusterConfig":
        return from_tables(cls, data)

    @classmethod
    def load(cls, path: Optional[str],
             overrides: Optional[dict[str, Any]] = None) -> "ClusterConfig":
        """The TOML file at ``path`` (None: defaults) with ``overrides`` laid over it."""
        data: dict[str, Any] = {}
        if path:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        return cls.from_dict(merge(data, overrides or {}))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

