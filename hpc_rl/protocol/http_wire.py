"""HTTP/1.1 on the wire, for http_client.py: a keep-alive request's bytes and an incremental response parser
(status; body by Content-Length, chunked, or up to the close; interim 1xx answers skipped), with the one error
every failure of the connection becomes (`EngineHTTPTransportError`, re-exported by http_client).

No sockets, no event loop: bytes in, (status, body) out.
"""

from __future__ import annotations


class EngineHTTPTransportError(ConnectionError):
    """The connection failed, was closed, timed out, or answered something that is not HTTP/1.1."""


def encode_request(method: str, path: str, host: str, auth: bytes, body: bytes | None) -> bytes:
    """One HTTP/1.1 request, keep-alive, with a JSON body (or none)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n".encode() + auth
    if body is None:
        return head + b"Content-Length: 0\r\n\r\n"
    return head + b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of header `name` in a lower-cased response head (each line ending in CRLF)."""
    start = head.find(b"\r\n" + name + b":")
    if start < 0:
        return None
    start += len(name) + 3
    return head[start:head.find(b"\r\n", start)].strip()


def _whole_responses(data: bytes) -> tuple[list[tuple[int, bytes]], int]:
    """The complete final responses with a Content-Length (and no Transfer-Encoding) at the start of `data`, and
    how many bytes they take: the common case of one read holding one answer, or a pipelined exchange's answers
    back to back (a weight update's 18 per engine), parsed by offset without the incremental parser's copies."""
    done: list[tuple[int, bytes]] = []
    position, size = 0, len(data)
    while position < size:
        end = data.find(b"\r\n\r\n", position)
        if end < 0 or not data.startswith(b"HTTP/1.", position):
            break
        head = data[position:end + 2].lower()
        start = head.find(b"\r\ncontent-length:")
        if start < 0 or b"\r\ntransfer-encoding:" in head:
            break
        status = int(head[9:12])
        stop = end + 4 + int(head[start + 17:head.find(b"\r\n", start + 17)])
        if status < 200 or stop > size:
            break
        done.append((status, data[end + 4:stop]))
        position = stop
    return done, position


class _ResponseParser:
    """Incremental HTTP/1.1 response parser: feed bytes, get (status, body) tuples."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.status: int | None = None
        self.length: int | None = None
        self.chunked = False
        self.until_close = False
        self.body: bytearray | bytes = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        done: list[tuple[int, bytes]] = []
        if not self.buffer and self.status is None:
            done, used = _whole_responses(data)
            if used == len(data):  # the common case: the read holds whole answers
                return done
            data = data[used:]
        self.buffer += data
        while True:
            if self.status is None and not self._head():
                return done
            finished = self._chunks() if self.chunked else self._fixed()
            if not finished:
                return done
            done.append((self.status or 0, bytes(self.body)))
            self.status, self.length, self.chunked, self.body = None, None, False, bytearray()

    def _head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self.buffer[:end + 2]).lower()
        del self.buffer[:end + 4]
        if not head.startswith(b"http/1.") or len(head) < 12:
            raise EngineHTTPTransportError(f"not an HTTP/1.1 response: {head[:80]!r}")
        status = int(head[9:12])
        if 100 <= status < 200:  # an interim response: the real one follows
            return self._head()
        self.status = status
        self.chunked = _header(head, b"transfer-encoding") == b"chunked"
        length = _header(head, b"content-length")
        if length is not None:
            self.length = int(length)
        elif not self.chunked and status not in (204, 304):
            self.until_close = True
        return True

    def _fixed(self) -> bool:
        if self.until_close:
            return False  # completed by close()
        need = self.length or 0
        if len(self.buffer) < need:
            return False
        with memoryview(self.buffer) as view:  # one copy out of the buffer (a slice, then bytes(), made two)
            self.body = view[:need].tobytes()
        del self.buffer[:need]
        return True

    def _chunks(self) -> bool:
        while True:
            end = self.buffer.find(b"\r\n")
            if end < 0:
                return False
            size = int(bytes(self.buffer[:end]).split(b";")[0], 16)
            if size == 0:
                trailer_end = self.buffer.find(b"\r\n\r\n", end)
                if trailer_end < 0:
                    return False
                del self.buffer[:trailer_end + 4]
                return True
            if len(self.buffer) < end + 2 + size + 2:
                return False
            self.body += self.buffer[end + 2:end + 2 + size]
            del self.buffer[:end + 2 + size + 2]

    def close(self) -> tuple[int, bytes] | None:
        """The peer closed: the body read up to the close, if that is how this response ends."""
        if self.status is not None and self.until_close:
            return self.status, bytes(self.body + self.buffer)
        return None
