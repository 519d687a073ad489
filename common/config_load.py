"""How TOML tables become a ``ClusterConfig`` (common/config.py): each table is built into
its dataclass, and a key that is unknown, moved or removed fails by name, so neither a typo
nor an old config starts a cluster that silently ignores it. ``merge`` lays ``--set``
overrides over a file, table by table."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

# Keys that moved into a table, so an old config fails with the new name.
MOVED_KEYS = {"use_store": "store.enabled", "store_nodes": "store.nodes",
              "store_segment_bytes": "store.segment_bytes", "store_ssd_bytes": "store.ssd_bytes",
              "store_ssd_dir": "store.ssd_dir"}
# Keys that did nothing and are gone, so an old config fails saying why.
REMOVED_KEYS = {"prefill_chunk": "a cluster's workers chunk prompts by token_budget "
                                 "(tokens per engine step); delete the line"}


def from_tables(cls: type, data: dict[str, Any]) -> Any:
    """``cls(**data)``, tables built into their dataclasses; a moved or removed key first
    fails with what to write instead."""
    moved = sorted(set(data) & set(MOVED_KEYS))
    if moved:
        raise ValueError("config keys moved: " + ", ".join(
            f"{k} is now {MOVED_KEYS[k]} ([store] table)" for k in moved))
    removed = sorted(set(data) & set(REMOVED_KEYS))
    if removed:
        raise ValueError("config keys removed: " + "; ".join(
            f"{k}: {REMOVED_KEYS[k]}" for k in removed))
    return _build(cls, data, "")


def _build(cls: type, data: dict[str, Any], table: str) -> Any:
    """``cls(**data)`` with its dataclass-typed fields built from nested tables; an unknown
    key is an error that names its table."""
    if not isinstance(data, dict):
        raise ValueError(f"[{table}] must be a table, not {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    if unknown:
        where = f" in [{table}]" if table else ""
        raise ValueError(f"unknown config keys{where}: {sorted(unknown)}")
    kwargs = dict(data)
    scalars = []
    for name, value in data.items():
        key = f"{table}.{name}".lstrip(".")
        if dataclasses.is_dataclass(hints[name]):
            kwargs[name] = _build(hints[name], value, key)
        else:
            scalars.append((key, hints[name], value))
    try:
        built = cls(**kwargs)  # its own checks first: they say more than a type can
    except TypeError:  # one of them tripped over a value of the wrong type
        for scalar in scalars:
            _check_scalar(*scalar)
        raise
    for scalar in scalars:
        _check_scalar(*scalar)
    return built


SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
           type(None): "left out"}


def _check_scalar(key: str, hint: Any, value: Any) -> None:
    """A key typed as a scalar (or an Optional one) holds one of its types: ``base_port =
    "8000"`` fails here by name, not as a TypeError in whichever process adds to it. An
    integer is a number; a bool is not. Other types (lists, tables) check themselves."""
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) \
        else (hint,)
    if not all(kind in SCALARS for kind in kinds):
        return
    if isinstance(value, bool):
        ok = bool in kinds
    else:
        ok = any(isinstance(value, kind) for kind in kinds) or (
            float in kinds and isinstance(value, int))
    if not ok:
        wanted = " or ".join(SCALARS[kind] for kind in kinds if kind is not type(None))
        raise ValueError(f"config key {key} must be {wanted}, not {value!r}")


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` laid over it, table by table (for ``--set``)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
