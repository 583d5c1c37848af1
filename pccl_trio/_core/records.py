"""The machinery of control messages: type-checked frozen records, their registry by
kind, and the msgpack codec.

Theory of operation
-------------------
A record is a frozen, keyword-only dataclass whose fields are checked against their
type hints in ``__post_init__`` (``check_field``: unsigned 64-bit integers, finite
floats, bounded strings and sequences, nested records), so a record that exists is a
valid record, whether it was built locally or decoded from the network. ``message``
registers a ``Message`` under its wire kind and direction. On the wire a record is a
msgpack array of its field values in declaration order (nested records are arrays
too); ``decode_message`` rebuilds and so re-validates it, and anything malformed raises
``RemoteProtocolError`` naming the message and field. The messages themselves are
declared in ``messages``.

Decoding is bounded before it is spent: msgpack itself refuses maps, extensions and
oversized arrays, strings and binaries in C, before any object is built; and a
message without a sequence field can only be small, so ``body_limit`` lets a reader
refuse an oversized frame of that kind from its header, before reading its body.
Texts the master builds from what peers sent (reasons, errors) go through
``bounded``, so no record it builds can exceed the limits it enforces on others.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import msgpack

from .errors import RemoteProtocolError

__all__ = [
    "C2M",
    "M2C",
    "MAX_REASON",
    "MAX_SEQUENCE",
    "MAX_STRING",
    "SMALL_BODY",
    "P2P",
    "U16_MAX",
    "U32_MAX",
    "U64_MAX",
    "Message",
    "Record",
    "body_limit",
    "bounded",
    "check_field",
    "decode_message",
    "encode_message",
    "message",
    "message_kinds",
    "record",
]

U16_MAX = (1 << 16) - 1
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
MAX_STRING = 4096
MAX_SEQUENCE = 1 << 16
#: Longest text ``bounded`` lets through (well below ``MAX_STRING``, so that a reason
#: quoting another reason still fits).
MAX_REASON = 1000
#: Largest body of a message without a sequence field: its strings at most
#: ``MAX_STRING`` characters of up to 4 UTF-8 bytes, a few scalars.
SMALL_BODY = 20 * 1024


def bounded(text: str, limit: int = MAX_REASON) -> str:
    """``text`` cut to at most ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    note = f"... ({len(text) - limit} more characters)"
    return text[: max(0, limit - len(note))] + note


def check_field(value: Any, hint: Any, where: str) -> None:
    """Raise ``RemoteProtocolError`` unless ``value`` matches the type ``hint``."""
    _checker(hint)(value, where)


def _invalid(value: Any, hint: Any, where: str) -> typing.NoReturn:
    raise RemoteProtocolError(f"{where}: invalid value {value!r:.80} for a field of type "
                              f"{getattr(hint, '__name__', hint)}")


_Check = typing.Callable[[Any, str], None]


@functools.cache
def _checker(hint: Any) -> _Check:
    """The check of values against ``hint``, built once per hint (every message is
    checked when it is built and when it is decoded, so this is on every send and
    receive path)."""
    check: _Check
    if hint is bool:
        def check(value: Any, where: str) -> None:
            if not isinstance(value, bool):
                _invalid(value, hint, where)
    elif hint is int:
        def check(value: Any, where: str) -> None:
            if not (isinstance(value, int) and not isinstance(value, bool)
                    and 0 <= value <= U64_MAX):
                _invalid(value, hint, where)
    elif hint is float:
        def check(value: Any, where: str) -> None:
            if not (isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value)):
                _invalid(value, hint, where)
    elif hint is str or hint is bytes:
        def check(value: Any, where: str) -> None:
            if not (isinstance(value, hint) and len(value) <= MAX_STRING):
                _invalid(value, hint, where)
    elif typing.get_origin(hint) is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        check_item = _checker(item_hint)

        def check(value: Any, where: str) -> None:
            if not isinstance(value, tuple):
                raise RemoteProtocolError(
                    f"{where}: expected a sequence, got {type(value).__name__}"
                )
            if len(value) > MAX_SEQUENCE:
                raise RemoteProtocolError(
                    f"{where}: {len(value)} items exceed the limit of {MAX_SEQUENCE}"
                )
            try:
                for item in value:
                    check_item(item, where)
            except RemoteProtocolError:
                # Name the first bad item (its index is only worth the cost now).
                for index, item in enumerate(value):
                    check_item(item, f"{where}[{index}]")
                raise
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        def check(value: Any, where: str) -> None:
            if not isinstance(value, hint):
                _invalid(value, hint, where)
    else:  # pragma: no cover - a message declared a field type this module can't check
        raise TypeError(f"unsupported field type {hint!r}")
    return check


class Record:
    """Mixin: type-check every field of a frozen dataclass after construction."""

    _HINTS: ClassVar[Mapping[str, Any]] = types.MappingProxyType({})
    #: Per field, in declaration order: its name, how errors name it, its check, and
    #: how its wire value becomes a field value (None: as it is).
    _FIELDS: ClassVar[tuple[tuple[str, str, _Check, _Convert | None], ...]] = ()

    def __post_init__(self) -> None:
        for name, where, check, _convert in type(self)._FIELDS:
            check(getattr(self, name), where)
        self._validate()

    def _validate(self) -> None:
        """Extra range checks beyond the field types; raise ``RemoteProtocolError``."""


class Message(Record):
    """Base of all control messages."""

    KIND: ClassVar[int]
    DIRECTION: ClassVar[str]
    #: Largest body of this kind, header included (None: ``SMALL_BODY`` unless the
    #: message has a sequence field, then the connection's control-frame limit).
    BODY_LIMIT: ClassVar[int | None] = None


C2M = "c2m"
M2C = "m2c"
P2P = "p2p"

_BY_KIND: dict[int, type[Message]] = {}
_R = TypeVar("_R", bound=type[Record])


def record(cls: _R) -> _R:
    hints = typing.get_type_hints(cls)
    cls._HINTS = types.MappingProxyType(
        {field.name: hints[field.name] for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    )
    cls._FIELDS = tuple(
        (name, f"{cls.__name__}.{name}", _checker(hint), _converter(hint))
        for name, hint in cls._HINTS.items()
    )
    return cls


def message(kind: int, direction: str) -> typing.Callable[[_R], _R]:
    def register(cls: _R) -> _R:
        assert issubclass(cls, Message)
        assert kind not in _BY_KIND, f"message kind {kind} registered twice"
        cls.KIND = kind
        cls.DIRECTION = direction
        _BY_KIND[kind] = cls
        return record(cls)

    return register


def _has_sequence(cls: type[Record]) -> bool:
    for hint in cls._HINTS.values():
        if typing.get_origin(hint) is tuple:
            return True
        if isinstance(hint, type) and issubclass(hint, Record) and _has_sequence(hint):
            return True
    return False


def body_limit(cls: type[Message], max_control_frame: int) -> int:
    """The largest control-frame body (kind header included) of a ``cls`` message that
    a connection limited to ``max_control_frame`` accepts."""
    if cls.BODY_LIMIT is not None:
        return min(cls.BODY_LIMIT, max_control_frame)
    if _has_sequence(cls):
        return max_control_frame
    return min(SMALL_BODY, max_control_frame)


def _to_wire(value: Any) -> Any:
    if isinstance(value, Record):
        return [
            getattr(value, name) if convert is None else _to_wire(getattr(value, name))
            for name, _where, _check, convert in type(value)._FIELDS
        ]
    if isinstance(value, tuple):
        return [_to_wire(item) for item in value]
    return value


_Convert = typing.Callable[[Any, str], Any]


def _converter(hint: Any) -> _Convert | None:
    """How a wire value of a field of type ``hint`` becomes the field's value: None for
    scalars (msgpack gave them as they are), a function for sequences and nested
    records."""
    if typing.get_origin(hint) is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        convert_item = _converter(item_hint)

        def convert(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise RemoteProtocolError(
                    f"{where}: expected an array, got {type(value).__name__}"
                )
            if convert_item is None:
                return tuple(value)
            return tuple(convert_item(item, f"{where}[{i}]") for i, item in enumerate(value))

        return convert
    if isinstance(hint, type) and issubclass(hint, Record) and not issubclass(hint, Message):
        return functools.partial(_build, hint)
    return None


def _build(cls: type[Record], fields: Any, where: str) -> Any:
    spec = cls._FIELDS
    if not isinstance(fields, list) or len(fields) != len(spec):
        raise RemoteProtocolError(
            f"{where}: expected {len(spec)} fields, got "
            f"{len(fields) if isinstance(fields, list) else type(fields).__name__}"
        )
    kwargs = {
        name: value if convert is None else convert(value, f"{where}.{name}")
        for (name, _where, _check, convert), value in zip(spec, fields, strict=True)
    }
    try:
        return cls(**kwargs)
    except RemoteProtocolError:
        raise
    except (TypeError, ValueError) as exc:  # pragma: no cover - defensive
        raise RemoteProtocolError(f"{where}: {exc}") from exc


def encode_message(message: Message) -> bytes:
    """Encode the fields of ``message`` (its kind travels in the frame header)."""
    return msgpack.packb(_to_wire(message), use_bin_type=True)  # type: ignore[no-any-return]


def decode_message(kind: int, payload: bytes | bytearray | memoryview) -> Message:
    """Decode and validate one control message.

    Raises:
        RemoteProtocolError: unknown kind, undecodable msgpack, or invalid fields.
    """
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise RemoteProtocolError(f"unknown message kind {kind}")
    try:
        fields = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            use_list=True,
            # Refused in C before any object is built: records are arrays of scalars
            # and arrays, never maps or extensions, with bounded strings and sequences.
            max_array_len=MAX_SEQUENCE,
            max_str_len=4 * MAX_STRING,
            max_bin_len=MAX_STRING,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types for garbage
        raise RemoteProtocolError(f"{cls.__name__}: undecodable payload ({exc})") from exc
    message: Message = _build(cls, fields, cls.__name__)
    return message


def message_kinds() -> Mapping[int, type[Message]]:
    """Every registered message class by kind (for tests and docs)."""
    return types.MappingProxyType(_BY_KIND)
