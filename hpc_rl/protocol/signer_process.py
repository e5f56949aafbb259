"""The frame signer's own program: HMAC-SHA256 of frames whose bytes the controller hands over, in a
process of its own (see frame_signer.py, the controller's side, for why and how it is used).

Owns the records of the local socketpair between the two and the loop that answers them. Standard
library only, run as ``python -I <this file> --socket-fd S --ring-fd R --ring-bytes B --chunk-bytes C``
(isolated: no site, no PYTHONPATH, nothing of hpc_rl imported; a small, fast-starting process).

    controller -> signer   REQUEST "<BIQQ" kind, chunk, job, length, then `length` bytes for KEY/INLINE
        KEY     the job secret (first record, once; it travels this socketpair only, never a network)
        OPEN    start job `job`'s HMAC
        INLINE  hash the `length` bytes that follow (a frame's prefix + header, its binding)
        RING    hash bytes [chunk * chunk_bytes, + length) of the shared ring, then answer FREED
        CLOSE   answer TAG with job `job`'s MAC;   DROP: forget job `job` (its writer gave up)
    signer -> controller   REPLY "<BIQ32s" kind, chunk, job, tag
        FREED   ring chunk `chunk` is hashed: the controller may fill it again
        TAG     job `job`'s MAC

The ring is a memfd the controller created and passed at start (pass_fds), mapped read-only here: the
payload crosses by one memcpy into it, not through the socket. Records are handled in order, one at a
time; a malformed one is a bug on the controller's side: the signer exits naming it (the controller
then signs in-process).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import mmap
import signal
import socket
import struct
import sys

REQUEST = struct.Struct("<BIQQ")
REPLY = struct.Struct("<BIQ32s")
KEY, OPEN, INLINE, RING, CLOSE, DROP = range(6)
FREED, TAG = 1, 2
PROGRAM = __file__
"""This file: what the controller runs (by path, isolated)."""
MAX_INLINE_BYTES = 64 << 20
"""Largest INLINE record the signer reads (a frame's header; the controller sends payloads by the ring)."""


def serve(sock: socket.socket, ring: mmap.mmap, chunk_bytes: int) -> None:
    """Answer records until the controller closes its end."""
    chunks = len(ring) // chunk_bytes
    ring_view = memoryview(ring)
    stream = sock.makefile("rb", buffering=1 << 16)
    key: bytes | None = None
    jobs: dict[int, hmac.HMAC] = {}
    try:
        while True:
            record = stream.read(REQUEST.size)
            if len(record) < REQUEST.size:
                return  # the controller closed the socketpair (or ended)
            kind, chunk, job, length = REQUEST.unpack(record)
            if kind in (KEY, INLINE):
                if length > MAX_INLINE_BYTES:
                    raise SystemExit(f"frame signer: an inline record of {length} bytes (limit {MAX_INLINE_BYTES})")
                data = stream.read(length)
                if len(data) < length:
                    return
                if kind == KEY:
                    key = data
                elif job in jobs:
                    jobs[job].update(data)
            elif kind == OPEN:
                if key is None:
                    raise SystemExit("frame signer: a job opened before the key came")
                jobs[job] = hmac.new(key, digestmod=hashlib.sha256)
            elif kind == RING:
                if chunk >= chunks or length > chunk_bytes:
                    raise SystemExit(f"frame signer: ring chunk {chunk} of {length} bytes is outside the ring "
                                     f"({chunks} chunks of {chunk_bytes} bytes)")
                mac = jobs.get(job)
                if mac is not None:
                    start = chunk * chunk_bytes
                    mac.update(ring_view[start:start + length])
                sock.sendall(REPLY.pack(FREED, chunk, job, b""))
            elif kind == CLOSE:
                mac = jobs.pop(job, None)
                if mac is None:
                    raise SystemExit(f"frame signer: CLOSE of job {job}, which is not open")
                sock.sendall(REPLY.pack(TAG, 0, job, mac.digest()))
            elif kind == DROP:
                jobs.pop(job, None)
            else:
                raise SystemExit(f"frame signer: unknown record kind {kind}")
    except (BrokenPipeError, ConnectionResetError):
        return
    finally:
        ring_view.release()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket-fd", type=int, required=True)
    parser.add_argument("--ring-fd", type=int, required=True)
    parser.add_argument("--ring-bytes", type=int, required=True)
    parser.add_argument("--chunk-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the controller ends us (EOF)
    sock = socket.socket(fileno=args.socket_fd)
    ring = mmap.mmap(args.ring_fd, args.ring_bytes, prot=mmap.PROT_READ)
    try:
        serve(sock, ring, args.chunk_bytes)
    finally:
        ring.close()
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
