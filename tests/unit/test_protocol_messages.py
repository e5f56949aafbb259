"""Pure tests of the protocol's encoding: messages, arrays of every wire dtype, framing checks, no pickle."""

from __future__ import annotations

import dataclasses
import pathlib
import struct
import types
import typing
from typing import Any, ClassVar, Literal

import numpy as np
import pytest
import torch

from hpc_rl.protocol import framing
from hpc_rl.protocol.arrays import WIRE_DTYPES, decode_arrays, encode_arrays
from hpc_rl.protocol.connection import envelope_from_frame, message_frame
from hpc_rl.protocol.errors import (
    BadMacError,
    BadMagicError,
    FieldMismatchError,
    FrameTooLargeError,
    MalformedFrameError,
    ProtocolError,
    UnknownMessageError,
    VersionMismatchError,
)
from hpc_rl.protocol.messages import (
    REGISTRY,
    Arrays,
    ErrorReply,
    Hello,
    Message,
    Ping,
    Pong,
    Shutdown,
    StatusReply,
    StatusRequest,
    Welcome,
    decode_message,
    encode_message,
)
from hpc_rl.protocol.secret import Secret
from tests.unit.protocol_frames import encode_frame

SECRET = Secret(key=b"s" * 32, origin="/run/test/secret")
NONCE = bytes(range(32))


def sender() -> framing.FrameCounter:
    return framing.FrameCounter(NONCE, framing.Direction.CLIENT_TO_SERVER)


def wire_round_trip(msg: Message, secret: Secret = SECRET) -> Message:
    """Encode to frame bytes and decode them again, as a receiver would."""
    header, parts = message_frame(msg, id=7)
    data = bytearray(encode_frame(secret, sender(), header, parts))
    header_len, _ = framing.parse_prefix(bytes(data[: framing.PREFIX.size]), framing.DEFAULT_MAX_FRAME_BYTES)
    h, payload = framing.open_frame(
        secret, sender(), bytes(data[: framing.PREFIX.size]), data[framing.PREFIX.size :], header_len
    )
    return envelope_from_frame(h, payload).message


EXAMPLES = [
    Hello(
        role="engine", rank=3, world_size=8, host="node1", pid=42, info={"url": "http://x:1", "gpus": [0, 1]}
    ),
    Welcome(connection_id=5, info={"step": 1}),
    ErrorReply(message="nope"),
    Ping(payload="p"),
    Pong(payload="p"),
    StatusRequest(),
    StatusReply(status={"a": [1, 2.5, None, True, "s"], "nested": {"x": {}}}),
    Shutdown(reason="done"),
    Arrays(arrays={"x": np.arange(6, dtype=np.int64).reshape(2, 3)}, meta={"k": 1}),
]


def _sample_value(hint: Any) -> Any:
    """A value of an annotated type, to build any registered message without knowing it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return args[0]
    if origin in (typing.Union, types.UnionType):
        return _sample_value(next(a for a in args if a is not type(None)))
    if origin is dict:
        return {"k": _sample_value(args[1])} if args else {"k": 1}
    if origin is list:
        return [_sample_value(args[0])] if args else [1]
    samples = {int: 3, float: 1.5, str: "s", bool: True, np.ndarray: np.arange(4, dtype=np.float32)}
    return samples.get(hint, None)


@pytest.mark.parametrize("type_name", sorted(REGISTRY))
def test_every_registered_message_round_trips(type_name: str) -> None:
    """Also covers message classes added later: their annotations must resolve (so they are checked)."""
    cls = REGISTRY[type_name]
    hints = typing.get_type_hints(cls)
    msg = cls(**{f.name: _sample_value(hints[f.name]) for f in dataclasses.fields(cls)})
    back = wire_round_trip(msg)
    assert type(back) is cls
    for f in dataclasses.fields(cls):
        a, b = getattr(msg, f.name), getattr(back, f.name)
        if isinstance(a, dict) and a and isinstance(next(iter(a.values())), np.ndarray):
            np.testing.assert_array_equal(a["k"], b["k"])
        else:
            assert a == b, f.name


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).TYPE)
def test_message_round_trip(msg: Message) -> None:
    back = wire_round_trip(msg)
    assert type(back) is type(msg)
    for f in dataclasses.fields(msg):
        a, b = getattr(msg, f.name), getattr(back, f.name)
        if isinstance(a, dict) and any(isinstance(v, np.ndarray) for v in a.values()):
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
        else:
            assert a == b


@pytest.mark.parametrize("dtype", [d for d in WIRE_DTYPES if d != "bfloat16"])
@pytest.mark.parametrize("shape", [(0,), (), (3,), (2, 0, 4), (5, 7)])
def test_numpy_arrays_of_each_dtype_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    arr = np.asarray(rng.random(shape) * 100).astype(dtype)
    back = wire_round_trip(Arrays(arrays={"a": arr}, meta={"dtype": dtype})).arrays["a"]
    assert isinstance(back, np.ndarray)
    assert back.dtype == np.dtype(dtype) and back.shape == shape
    np.testing.assert_array_equal(back, arr)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int8,
        torch.uint8,
        torch.bool,
    ],
)
def test_torch_tensors_come_back_as_torch_tensors(dtype: torch.dtype) -> None:
    t = (torch.arange(12, dtype=torch.float32).reshape(3, 4) - 3).to(dtype)
    scalar = torch.tensor(1.5).to(dtype)
    back = wire_round_trip(Arrays(arrays={"t": t, "s": scalar, "empty": t[:0]}))
    for name, ref in {"t": t, "s": scalar, "empty": t[:0]}.items():
        got = back.arrays[name]
        assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.shape == ref.shape
        assert torch.equal(got, ref)


def test_arrays_nested_in_lists_and_non_contiguous_inputs() -> None:
    base = np.arange(20, dtype=np.float32).reshape(4, 5)
    parts = [base[:, 1], base.T, np.array(7, dtype=np.int32), np.zeros((0, 3), dtype=np.float16)]
    back = wire_round_trip(StatusReply(status={"parts": parts, "n": np.int64(3)}))
    assert back.status["n"] == 3 and isinstance(back.status["n"], int)
    for a, b in zip(parts, back.status["parts"]):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype and a.shape == b.shape


def test_decoded_arrays_are_zero_copy_aligned_and_writable() -> None:
    descriptors, parts = encode_arrays([np.ones(3, dtype=np.int8), np.arange(4, dtype=np.float64)])
    payload = bytearray(b"".join(parts))
    _, b = decode_arrays(descriptors, memoryview(payload))
    assert descriptors[1]["offset"] % 64 == 0
    b[0] = 42.0  # writes land in the received buffer: no copy was made
    assert np.frombuffer(payload, dtype=np.float64, count=1, offset=descriptors[1]["offset"])[0] == 42.0


def test_disallowed_values_are_refused_at_the_sender() -> None:
    with pytest.raises(ProtocolError, match="dtype object"):
        message_frame(Arrays(arrays={"o": np.array([object()], dtype=object)}))
    with pytest.raises(ProtocolError, match="complex128"):
        message_frame(Arrays(arrays={"c": np.zeros(2, dtype=np.complex128)}))
    with pytest.raises(FieldMismatchError, match="cannot send a set"):
        encode_message(StatusReply(status={"s": {1, 2}}))
    with pytest.raises(FieldMismatchError, match="keys must be str"):
        encode_message(StatusReply(status={1: 2}))
    with pytest.raises(FieldMismatchError, match=r"Hello.rank: expected int, got str"):
        encode_message(Hello(role="trainer", rank="0"))  # type: ignore[arg-type]
    with pytest.raises(FieldMismatchError, match="is not one of"):
        encode_message(Hello(role="wizard"))  # type: ignore[arg-type]


def test_decode_rejects_unknown_types_versions_and_fields() -> None:
    header, arrays = encode_message(Ping(payload="x"))
    with pytest.raises(UnknownMessageError, match="unknown message type 'pingg'"):
        decode_message({**header, "type": "pingg"}, arrays)
    with pytest.raises(UnknownMessageError, match="the peer sent v9, this side speaks v1"):
        decode_message({**header, "v": 9}, arrays)
    with pytest.raises(FieldMismatchError, match=r"unknown fields \['extra'\]"):
        decode_message({**header, "fields": {"payload": "x", "extra": 1}}, arrays)
    with pytest.raises(FieldMismatchError, match=r"missing fields \['message'\]"):
        decode_message({"type": "error", "v": 1, "fields": {}}, [])
    with pytest.raises(FieldMismatchError, match="Ping.payload: expected str"):
        decode_message({**header, "fields": {"payload": 3}}, arrays)
    with pytest.raises(MalformedFrameError, match="bad array reference"):
        decode_message({"type": "arrays", "v": 1, "fields": {"arrays": {"a": {"$a": 3}}}}, [])


def test_bad_array_descriptors_are_clear_errors() -> None:
    payload = memoryview(bytearray(16))
    with pytest.raises(MalformedFrameError, match="dtype 'object'"):
        decode_arrays([{"dtype": "object", "shape": [1], "offset": 0, "nbytes": 8}], payload)
    with pytest.raises(MalformedFrameError, match="do not hold shape"):
        decode_arrays([{"dtype": "float32", "shape": [3], "offset": 0, "nbytes": 8}], payload)
    with pytest.raises(MalformedFrameError, match="beyond the payload"):
        decode_arrays([{"dtype": "float64", "shape": [2], "offset": 8, "nbytes": 16}], payload)


def test_adding_a_message_is_five_lines() -> None:
    @dataclasses.dataclass(kw_only=True)
    class _TestOnlyAbort(Message):
        TYPE: ClassVar[str] = "test_only_abort"
        VERSION: ClassVar[int] = 2
        request_ids: list[str]

    try:
        assert wire_round_trip(_TestOnlyAbort(request_ids=["a", "b"])) == _TestOnlyAbort(
            request_ids=["a", "b"]
        )
        with pytest.raises(TypeError, match="already used"):

            @dataclasses.dataclass(kw_only=True)
            class _Clash(Message):
                TYPE: ClassVar[str] = "ping"
    finally:
        REGISTRY.pop("test_only_abort", None)


def _frame(secret: Secret = SECRET, counter: framing.FrameCounter | None = None) -> bytes:
    header, parts = message_frame(Ping(payload="hi"), id=1)
    return encode_frame(secret, counter or sender(), header, parts)


def _open(
    data: bytes,
    max_frame_bytes: int = framing.DEFAULT_MAX_FRAME_BYTES,
    counter: framing.FrameCounter | None = None,
) -> None:
    prefix = data[: framing.PREFIX.size]
    header_len, _ = framing.parse_prefix(prefix, max_frame_bytes)
    body = bytearray(data[framing.PREFIX.size :])
    framing.open_frame(SECRET, counter or sender(), prefix, body, header_len)


def test_framing_checks() -> None:
    good = _frame()
    _open(good)
    with pytest.raises(BadMacError, match=r"does not hold this job's secret \(/run/test/secret\)"):
        _open(_frame(Secret(key=b"w" * 32)))
    tampered = bytearray(good)
    tampered[framing.PREFIX.size + 3] ^= 1
    with pytest.raises(BadMacError):
        _open(bytes(tampered))
    with pytest.raises(BadMagicError, match="looks like HTTP"):
        _open(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    v = framing.PROTOCOL_VERSION
    wrong_version = struct.pack("!4sH", framing.MAGIC, v + 1) + good[6:]
    with pytest.raises(VersionMismatchError, match=f"peer sent frame format v{v + 1}, this side speaks v{v}"):
        _open(wrong_version)
    with pytest.raises(FrameTooLargeError, match="exceeds the limit of 64 bytes"):
        _open(good, max_frame_bytes=64)
    huge = framing.PREFIX.pack(framing.MAGIC, framing.PROTOCOL_VERSION, 0, 10, 1 << 62)
    with pytest.raises(FrameTooLargeError, match="rejected before reading it"):
        framing.parse_prefix(huge, framing.DEFAULT_MAX_FRAME_BYTES)


def test_no_pickle_in_the_protocol_package() -> None:
    package = pathlib.Path(framing.__file__).parent
    offenders = [p.name for p in package.rglob("*.py") if "pickle" in p.read_text()]
    assert offenders == []


def test_mac_is_bound_to_nonce_direction_and_frame_number() -> None:
    """A frame verifies only as the frame it was sent as; the error names replays and reflections."""
    out = sender()
    frames = [_frame(counter=out) for _ in range(3)]
    receiver = sender()
    for data in frames:
        _open(data, counter=receiver)
    assert receiver.next_number == 3
    with pytest.raises(
        BadMacError,
        match=r"replayed or reordered frame: it is frame #1 of this connection's "
        r"client->server stream, but #3 was due",
    ):
        _open(frames[1], counter=receiver)
    assert receiver.next_number == 3  # a rejected frame does not move the counter
    skipped = sender()
    with pytest.raises(BadMacError, match="it is frame #1 .* but #0 was due"):
        _open(frames[1], counter=skipped)
    other_nonce = framing.FrameCounter(bytes(32), framing.Direction.CLIENT_TO_SERVER)
    with pytest.raises(BadMacError, match="replayed from another connection"):
        _open(frames[0], counter=other_nonce)
    back = framing.FrameCounter(NONCE, framing.Direction.SERVER_TO_CLIENT)
    with pytest.raises(BadMacError, match=r"reflected frame: it is frame #0 of this connection's client->"):
        _open(frames[0], counter=back)
    with pytest.raises(BadMacError, match="a server hello where client->server frame #0 was due"):
        _open(_frame(counter=framing.FrameCounter.server_hello()))
    outgoing, incoming = framing.session_counters(NONCE, server=True)
    assert (outgoing.direction, incoming.direction) == (
        framing.Direction.SERVER_TO_CLIENT,
        framing.Direction.CLIENT_TO_SERVER,
    )
