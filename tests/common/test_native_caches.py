"""common/native_caches.py: the computing roles' oneDNN caches are capped, unless set."""
from __future__ import annotations

from common import native_caches


def test_caps_by_role_and_leaves_a_set_variable() -> None:
    env: dict[str, str] = {"LRU_CACHE_CAPACITY": "8"}
    native_caches.bound("prefill", env)
    assert env == {"LRU_CACHE_CAPACITY": "8", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
    env = {}
    native_caches.bound("decode", env)
    assert env == {"LRU_CACHE_CAPACITY": "256", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}
    env = {}
    native_caches.bound("router", env)
    assert env == {}
