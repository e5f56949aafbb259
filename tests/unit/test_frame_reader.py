"""The controller's frame reader (rollout/answer_pool.py `_FrameReader`): an answer's payload received straight into
the arrays the samples keep, equal to what the worker sent, whatever pieces the socket hands over; other payloads as
bytes; a worker gone mid-frame fails what it held."""

from __future__ import annotations

import asyncio
import socket
from array import array
from typing import Any

import orjson
import pytest

from hpc_rl.rollout.answer_pool import _FrameReader
from hpc_rl.rollout.answer_workers import compact_answers, encode_frame, place_arrays, split_arrays
from tests.unit.waiting import wait_until


class FakeWorker:
    """Stands in for answer_pool._Worker: records what the reader hands it."""

    def __init__(self) -> None:
        self.frames: list[tuple[dict[str, Any], Any]] = []
        self.ended_with: list[Exception | None] = []

    def answered(self, header: dict[str, Any], payload: Any) -> None:
        self.frames.append((header, payload))

    def ended(self, error: Exception | None) -> None:
        self.ended_with.append(error)


def answer_frame(request_id: int, lengths: list[int]) -> tuple[list[Any], list[dict[str, Any]]]:
    """A worker's frame of a batched answer with these response lengths, and the answers it stands for."""
    items = [{"text": "t", "output_ids": [7 * n + i for i in range(n)],
              "meta_info": {"output_token_logprobs": [[-0.5 * i - n / 7, 1, None] for i in range(n)]}}
             for n in lengths]
    ok, parsed = compact_answers(orjson.dumps(items))
    assert ok
    expected = [{**item, "output_ids": list(item["output_ids"]),
                 "meta_info": {"output_token_logprobs": list(item["meta_info"]["output_token_logprobs"])}}
                for item in parsed]
    stripped, specs, buffers = split_arrays(parsed)
    return encode_frame({"id": request_id, "status": 200, "body": stripped, "arrays": specs}, buffers), expected


class ShortReads:
    """A socket whose reads return at most `limit` bytes (the kernel may return less than it holds)."""

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self.sock, self.limit = sock, limit

    def recvmsg_into(self, buffers: list[memoryview]) -> tuple[int, list[Any], int, Any]:
        left, cut = self.limit, []
        for buffer in buffers:
            if left == 0:
                break
            cut.append(buffer[:left])
            left -= len(cut[-1])
        return self.sock.recvmsg_into(cut)

    def recv_into(self, buffer: memoryview) -> int:
        return self.sock.recv_into(buffer[:self.limit])


async def read_frames(chunks: list[bytes], *, frames: int = 0, close: bool = False,
                      scatter: int | None = 0) -> FakeWorker:
    """Send `chunks` (one write each, a loop turn apart) into a reader on a socketpair; what it delivered once
    `frames` frames came (and, with `close`, once the reader saw the end). `scatter`: None, no scatter reads
    (asyncio's reads only)."""
    ours, theirs = socket.socketpair()
    worker = FakeWorker()
    reader = _FrameReader(worker)  # type: ignore[arg-type]
    if scatter is not None:  # 0: the socket itself; else reads of at most that many bytes
        reader.sock = ShortReads(ours, scatter) if scatter else ours  # type: ignore[assignment]
    transport, _ = await asyncio.get_running_loop().create_unix_connection(lambda: reader, sock=ours)
    theirs.setblocking(False)
    for chunk in chunks:
        await asyncio.get_running_loop().sock_sendall(theirs, chunk)
        for _ in range(3):
            await asyncio.sleep(0)
    await wait_until(lambda: len(worker.frames) >= frames, what=f"{frames} frame(s) delivered")
    if close:
        theirs.close()
        await wait_until(lambda: bool(worker.ended_with), what="the reader's end")
    else:
        transport.close()
        theirs.close()
        await asyncio.sleep(0)
    return worker


def pieces(frame: list[Any], size: int) -> list[bytes]:
    data = b"".join(bytes(memoryview(part).cast("B")) for part in frame)
    return [data[start:start + size] for start in range(0, len(data), size)]


@pytest.mark.parametrize("chunk", [1, 5, 4096, 1 << 22])
@pytest.mark.parametrize("scatter", [0, None, 3001])
def test_answer_payload_lands_in_arrays_equal_to_the_workers(chunk: int, scatter: int | None) -> None:
    first, expected_first = answer_frame(3, [5, 0, 2000, 1])
    second, expected_second = answer_frame(4, [3, 3])
    worker = asyncio.run(read_frames(pieces(first + second, chunk), frames=2, scatter=scatter))
    assert [header["id"] for header, _ in worker.frames] == [3, 4]
    for (header, arrays), expected in zip(worker.frames, [expected_first, expected_second]):
        assert isinstance(arrays, list) and all(isinstance(values, array) for values in arrays)
        body = place_arrays(header["body"], header["arrays"], arrays)
        got = [{**item, "output_ids": item["output_ids"].tolist(),
                "meta_info": {"output_token_logprobs": item["meta_info"]["output_token_logprobs"].tolist()}}
               for item in body]
        assert got == expected
        for values in arrays:  # no view of the reader's holds them: a sample can grow them later
            values.append(values[0] if len(values) else 0)


def test_other_payloads_arrive_as_bytes_and_bad_array_specs_fail_as_before() -> None:
    raw = encode_frame({"id": 1, "status": 503, "raw": True}, [b"engine overloaded"])
    empty = encode_frame({"id": 2, "error": "connection refused"})
    bad = encode_frame({"id": 5, "status": 200, "body": [{"output_ids": None}], "arrays": [[0, "ids", 5]]},
                       [array("q", [1, 2])])
    worker = asyncio.run(read_frames(pieces(raw + empty + bad, 7), frames=3))
    (h1, p1), (h2, p2), (h5, p5) = worker.frames
    assert (h1["id"], bytes(p1)) == (1, b"engine overloaded")
    assert (h2["error"], bytes(p2)) == ("connection refused", b"")
    assert isinstance(p5, bytearray) and bytes(p5) == array("q", [1, 2]).tobytes()  # join_arrays reads it as before


def test_a_worker_gone_mid_frame_ends_the_reader_without_an_answer() -> None:
    frame, _ = answer_frame(9, [4000, 4000])
    data = pieces(frame, 1 << 22)[0]
    worker = asyncio.run(read_frames([data[:len(data) // 2]], close=True))
    assert worker.frames == [] and worker.ended_with == [None]
