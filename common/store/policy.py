"""The store master's policy knobs: the ``[store.policy]`` table of a cluster config
(common/config.py). The master that applies them is services/store_master/metadata.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetadataConfig:
    put_timeout_s: float = 10.0
    lease_s: float = 5.0
    high_watermark: float = 0.9
    evict_fraction: float = 0.1
    heartbeat_timeout_s: float = 5.0
    alignment: int = 64
    hot_read_threshold: int = 4  # reads per DRAM replica within hot_window_s; 0: off
    hot_window_s: float = 10.0
    max_replicas: int = 2  # hot replication stops here (puts may ask for more)
    # the slowest rate a healthy path moves bytes (TCP from GPU memory: ~1.5 GB/s seen on
    # an H200): a grant lasts its base time plus its bytes at this rate (``grant_s``)
    min_bytes_per_s: float = float(1 << 30)
