"""A TensorBoard event file of scalars, written without torch or tensorboard.

Owns: the bytes of `events.out.tfevents.*` for scalar summaries: TFRecord framing (length, masked
CRC-32C of the length, the record, masked CRC-32C of the record) around hand-encoded `Event`
protobufs (`wall_time`, `step`, `file_version` on the first record, `summary.value[].{tag,
simple_value}`), the same fields torch's `SummaryWriter.add_scalar` writes. The controller logs its
scalars through this so it never imports torch (issue 11: a light control plane); TensorBoard reads
the file like any other. A write that fails (a full disk, a quota) raises OSError naming this file (the errno
kept): "no space left on /scratch/run/tensorboard (writing events.out.tfevents...)", not a bare "[Errno 28] No
space left on device" that names nothing (issue 37).

Why not tensorboard's `EventFileWriter` (a dependency; issue 30 asked, measured Nov 29 on the 2-core dev box,
load ~1, Python 3.11, tensorboard 2.21, best of 5 runs):
- It writes on a background thread: `add_event` returns before the write, and a full disk (tried on /dev/full)
  surfaces at a later `flush`/`add_event` as a bare `[Errno 28] No space left on device`, with a thread
  traceback on stderr. `add_scalar` here raises at once, naming the file (test_small_faults.py's two full-disk
  tests swap `_file` and expect exactly that).
- Import: `tensorboard.summary.writer.*` imports `tensorboard.summary` (v1 summaries, numpy, protobuf): on top of
  the controller's own imports (`hpc_rl.controller.rollout_stack`) +135-157 ms and +385 modules; this module adds
  none. With tensorflow installed its file I/O goes through `tf.io.gfile`, importing all of tensorflow.
- Write time per 1000 scalars (ScalarLog's pattern: flush every 10): this module 11 ms; `EventFileWriter` with
  `event_pb2` events 19 ms; tensorboard's synchronous `RecordWriter` around our bytes 8 ms (its CRC-32C is also
  pure Python, table-driven), but it brings the same import cost as above for ~10 lines of framing.
So TensorBoard's code is the reader (`EventAccumulator`, in test_event_file.py), not the writer.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hpc_rl.telemetry.run_files import describe_write_error

T = TypeVar("T")

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected
_CRC32C_TABLE = []
for _byte in range(256):
    _crc = _byte
    for _ in range(8):
        _crc = (_crc >> 1) ^ _CRC32C_POLY if _crc & 1 else _crc >> 1
    _CRC32C_TABLE.append(_crc)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 on the wire: negative steps are ten-byte two's complement
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def encode_scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """`Event{wall_time, step, summary{value{tag, simple_value}}}` as protobuf bytes."""
    summary_value = _length_delimited(1, tag.encode()) + bytes([2 << 3 | 5]) + struct.pack("<f", value)
    summary = _length_delimited(1, summary_value)
    return (bytes([1 << 3 | 1]) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
            + _length_delimited(5, summary))


def encode_version_event(wall_time: float) -> bytes:
    """The first record of every event file: `Event{wall_time, file_version: "brain.Event:2"}`."""
    return bytes([1 << 3 | 1]) + struct.pack("<d", wall_time) + _length_delimited(3, b"brain.Event:2")


def frame_record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


class ScalarEventFile:
    """Appends scalar events to one new event file in `log_dir` (name as TensorBoard expects)."""

    def __init__(self, log_dir: str | Path, *, filename_suffix: str = "") -> None:
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.0{filename_suffix}"
        self.path = Path(log_dir) / name
        self._named(lambda: Path(log_dir).mkdir(parents=True, exist_ok=True))
        self._file = self._named(lambda: open(self.path, "ab"))
        self._named(lambda: self._file.write(frame_record(encode_version_event(now))))
        self._named(self._file.flush)

    def _named(self, write: Callable[[], T]) -> T:
        """`write()`, its OSError said with this file's name (the errno kept, for callers that test it)."""
        try:
            return write()
        except OSError as error:
            raise OSError(error.errno, f"TensorBoard event file: {describe_write_error(error, self.path)}") from error

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        record = frame_record(encode_scalar_event(tag, float(value), int(step), time.time()))
        self._named(lambda: self._file.write(record))

    def flush(self) -> None:
        self._named(self._file.flush)

    def close(self) -> None:
        if not self._file.closed:
            self._named(self._file.close)
