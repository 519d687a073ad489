"""The codec's compiled field checks (``common/ipc.py`` ``_checker``) accept exactly what
the check they replaced accepted: that one introspected the hint for every field of every
message. Every hint of every registered message, against random JSON values."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from hypothesis import given, settings
from hypothesis import strategies as st

import common.protocol  # noqa: F401 - registers the messages
import common.status_protocol  # noqa: F401
from common.ipc import _REGISTRY, _SCALAR_TYPES, _check, _nested
from common.store import protocol as _store  # noqa: F401

SCALARS: dict[Any, set[type]] = _SCALAR_TYPES


def reference(value: Any, hint: Any) -> bool:
    """The check before 2026-11-29, verbatim in its logic."""
    if hint is Any:
        return True
    origin = get_origin(hint)
    if origin is Union:
        return any(reference(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        args = get_args(hint)
        if not isinstance(value, list):
            return False
        inner = args[0] if args else Any
        if inner is Any:
            return True
        allowed = SCALARS.get(inner)
        if allowed is not None:
            return set(map(type, value)) <= allowed
        return all(reference(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def plain_hints() -> list[Any]:
    """Every field hint of every message that names no dataclass."""
    hints = set()
    for cls in _REGISTRY.values():
        for f in dataclasses.fields(cls):
            hint = get_type_hints(cls)[f.name]
            if _nested(hint) is None:
                hints.add(hint)
    return sorted(hints, key=repr)


# and the shapes no message has today, that the checks still build
EXTRA = [list[list[int]], Optional[list[str]], tuple[int, ...], Union[int, str, None],
         list[Any], list, dict, Any, type(None)]
HINTS = plain_hints() + EXTRA
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                max_size=3),
    max_leaves=8)


def test_the_messages_hints_cover_the_common_kinds() -> None:
    kinds = {get_origin(h) for h in plain_hints()} | {h for h in plain_hints() if h in SCALARS}
    assert {Union, list, dict, int, float, str, bool} <= kinds, HINTS


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from(HINTS))
def test_compiled_checks_equal_the_introspecting_one(value: Any, hint: Any) -> None:
    assert _check(value, hint) == reference(value, hint)
