"""ZeroMQ plumbing: one socket factory, one codec.

Every wire message is a frozen dataclass registered with ``@message``; it travels as
orjson ``{"type": name, ...fields}``. ``decode`` validates field names and basic types and
raises ``ProtocolError`` for anything malformed; service loops log and drop those.
No pickle on the wire; bulk bytes never ride here.
"""
from __future__ import annotations

import dataclasses
import logging
import typing
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import orjson
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type] = {}
_HINTS: dict[type, dict[str, Any]] = {}


class ProtocolError(ValueError):
    """A frame that is not a valid message."""


def message(cls: type) -> type:
    """Class decorator: make ``cls`` a frozen dataclass and register it by class name."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    name = cls.__name__
    if name in _REGISTRY:
        raise RuntimeError(f"duplicate message type {name}")
    _REGISTRY[name] = cls
    return cls


def encode(msg: Any) -> bytes:
    body = {"type": type(msg).__name__}
    for f in dataclasses.fields(msg):
        body[f.name] = getattr(msg, f.name)
    return orjson.dumps(body)


# JSON scalar types each hint accepts; a bool is never an int or a float here.
_SCALAR_TYPES: dict[Any, set[type]] = {
    int: {int}, float: {int, float}, str: {str}, bool: {bool},
}


def _check(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = get_origin(hint)
    if origin is Union:
        return any(_check(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        args = get_args(hint)
        if not isinstance(value, list):
            return False
        inner = args[0] if args else Any
        allowed = _SCALAR_TYPES.get(inner)
        if allowed is not None:  # fast path, at C speed: token ids, key lists
            return set(map(type, value)) <= allowed
        return all(_check(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def decode(frame: bytes) -> Any:
    try:
        body = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"not JSON: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        raise ProtocolError("frame has no message type")
    cls = _REGISTRY.get(body.pop("type"))
    if cls is None:
        raise ProtocolError("unknown message type")
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in body:
            value = body.pop(f.name)
            if not _check(value, hints[f.name]):
                raise ProtocolError(f"{cls.__name__}.{f.name} has the wrong type")
            if get_origin(hints[f.name]) is tuple or hints[f.name] is tuple:
                value = tuple(value)
            kwargs[f.name] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{cls.__name__} lacks field {f.name}")
    if body:
        raise ProtocolError(f"{cls.__name__} has unknown fields {sorted(body)}")
    return cls(**kwargs)


def make_socket(ctx: zmq.asyncio.Context, kind: int, address: str, bind: bool,
                identity: Optional[bytes] = None, hwm: int = 0) -> zmq.asyncio.Socket:
    """The one socket factory: no linger, unbounded high-water marks unless given."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def try_decode(frame: bytes, where: str) -> Optional[Any]:
    """Decode or log-and-drop: the one place service loops turn frames into messages."""
    try:
        return decode(frame)
    except ProtocolError as exc:
        log.warning("%s: dropped malformed frame (%s)", where, exc)
        return None


__all__ = ["message", "encode", "decode", "try_decode", "make_socket", "ProtocolError",
           "typing"]
