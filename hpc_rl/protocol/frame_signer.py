"""Big frames' MACs computed in a process of their own: the coordinating process copies the payload once
into a shared ring and writes it to the socket meanwhile; the signer process hashes it and answers the
32-byte tag that ends the frame.

Why: a train batch is ~21 bytes per token (~72 kB per full-length sample) and goes to every rank of its
data-parallel group; HMAC-SHA256 of it ran ~2 GB/s here, 0.27 of the loop thread's 1.59 CPU-s at
bench_scale's N=256 (4,096 samples, 8 ranks), while the copy into the ring runs ~20 GB/s. The wire is
unchanged: the same bytes, the same MAC over prefix + header + payload + binding (framing.py), so the
receiving side needs nothing new; frame numbers still follow the wire order, since a connection holds its
write lock from the frame's first byte to its tag.

    Connection._write ──> begin(frame) ──> None: sign here (small frame, or no signer)
                                      └──> a job: OPEN, INLINE(prefix + header), RING(chunk)...,
                                           INLINE(binding), CLOSE ──> TAG
    ring: `chunks` x `chunk_bytes` of a memfd; a chunk is filled again only after the signer said FREED

The process (signer_process.py, standard library only) starts at the first big frame and gets the job
secret over its socketpair (never a network). If it dies, hangs (no answer for `stall_timeout_s`) or
cannot start, the frame in flight and every later one is signed in this process, once said in the log:
no frame is lost or reordered. The ring is released then, or at `close` (which ends the process); it is a
memfd: nothing is left in /dev/shm whatever happens, the kernel frees it with its last user.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
from collections import deque

from hpc_rl.protocol.framing import MAC_BYTES, UnsignedFrame
from hpc_rl.protocol.secret import Secret
from hpc_rl.protocol.signer_process import (CLOSE, DROP, FREED, INLINE, KEY, OPEN, PROGRAM, REPLY, REQUEST, RING,
                                            TAG)

log = logging.getLogger("hpc_rl.protocol")

MIN_FRAME_BYTES = 1 << 20
"""Frames with a smaller payload are signed in process (their HMAC costs under 0.5 ms)."""
CHUNK_BYTES = 4 << 20
RING_CHUNKS = 4
STALL_TIMEOUT_S = 30.0
"""The signer is given up when it leaves a frame without an answer this long (its 4 MiB chunk takes ~2 ms)."""


class SignerLost(RuntimeError):
    """The signer process ended, hung or could not start: the frame is signed in process."""


class _Replies(asyncio.Protocol):
    """The controller's end of the socketpair: fixed-size replies, handed to the signer as they come."""

    def __init__(self, signer: FrameSigner) -> None:
        self.signer = signer
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        size = REPLY.size
        whole = len(self.buffer) // size * size
        for offset in range(0, whole, size):
            self.signer._on_reply(*REPLY.unpack_from(self.buffer, offset))
        del self.buffer[:whole]

    def connection_lost(self, exc: Exception | None) -> None:
        self.signer._lose(f"closed its socket{f' ({exc})' if exc else ''}")


class SigningJob:
    """One frame's MAC being computed by the signer: `tag()` is it, or None when the signer was lost."""

    def __init__(self, signer: FrameSigner, job_id: int) -> None:
        self.signer, self.id = signer, job_id
        self.tag_future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.feeder: asyncio.Task[None] | None = None

    async def tag(self) -> bytes | None:
        """The frame's MAC from the signer, or None (lost meanwhile: the caller signs in process)."""
        try:
            assert self.feeder is not None
            await self.feeder
            return await asyncio.wait_for(asyncio.shield(self.tag_future), self.signer.stall_timeout_s)
        except SignerLost:
            return None
        except TimeoutError:
            self.signer._lose(f"left frame job {self.id} without its MAC for {self.signer.stall_timeout_s:g} s")
            return None
        except Exception as error:  # a bug feeding it: this frame (and the next) still go out, signed here
            log.exception("frame signer job %d failed", self.id)
            self.signer._lose(f"failed feeding frame job {self.id}: {type(error).__name__}: {error}")
            return None

    def abandon(self) -> None:
        """The frame was not sent to the end (cancelled, connection lost): stop feeding, forget the job."""
        if self.feeder is not None:
            if not self.feeder.done():
                self.feeder.cancel()
            elif not self.feeder.cancelled():
                self.feeder.exception()  # (retrieved: SignerLost, if any, was dealt with by the caller)
        if not self.tag_future.done():
            self.tag_future.cancel()
            with contextlib.suppress(SignerLost):
                self.signer._send(DROP, 0, self.id)
        self.signer._jobs.pop(self.id, None)


class FrameSigner:
    """A signer process for one job secret, started at its first big frame; see the module docstring."""

    def __init__(self, secret: Secret, *, min_frame_bytes: int = MIN_FRAME_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 chunks: int = RING_CHUNKS, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        if chunk_bytes % mmap.PAGESIZE or chunks < 1:
            raise ValueError(f"ring of {chunks} chunks of {chunk_bytes} bytes: chunks must be whole pages, >= 1")
        self.secret, self.min_frame_bytes = secret, min_frame_bytes
        self.chunk_bytes, self.chunks, self.stall_timeout_s = chunk_bytes, chunks, stall_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.lost: str | None = None
        """Why the signer is not used any more (None while it is, or before it starts)."""
        self.signed = 0
        """Frames whose MAC the signer computed."""
        self._transport: asyncio.Transport | None = None
        self._ring: mmap.mmap | None = None
        self._ring_view: memoryview | None = None
        self._free: list[int] = []
        self._waiting: deque[asyncio.Future[int]] = deque()
        self._jobs: dict[int, SigningJob] = {}
        self._ids = itertools.count(1)
        self._starting: asyncio.Lock | None = None

    @property
    def pid(self) -> int | None:
        """The signer process's pid while it runs."""
        return self.process.pid if self.process is not None and self.lost is None else None

    async def begin(self, frame: UnsignedFrame) -> SigningJob | None:
        """Start computing `frame`'s MAC in the signer (its payload is copied into the ring as the ring frees
        up); None when the frame is to be signed in process (small, or no signer)."""
        if frame.payload_bytes < self.min_frame_bytes or self.lost is not None:
            return None
        if self._transport is None and not await self._start():
            return None
        job = SigningJob(self, next(self._ids))
        self._jobs[job.id] = job
        job.feeder = asyncio.get_running_loop().create_task(self._feed(job, frame), name=f"frame signer job {job.id}")
        return job

    async def _start(self) -> bool:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._transport is not None or self.lost is not None:
                return self.lost is None
            ring_bytes = self.chunk_bytes * self.chunks
            ours = theirs = None
            ring_fd = -1
            try:
                ours, theirs = socket.socketpair()
                ring_fd = os.memfd_create("hpc_rl-frame-signer")
                os.ftruncate(ring_fd, ring_bytes)
                self._ring = mmap.mmap(ring_fd, ring_bytes)
                self._ring_view = memoryview(self._ring)
                self.process = subprocess.Popen(
                    [sys.executable, "-I", PROGRAM, "--socket-fd", str(theirs.fileno()), "--ring-fd", str(ring_fd),
                     "--ring-bytes", str(ring_bytes), "--chunk-bytes", str(self.chunk_bytes)],
                    pass_fds=(theirs.fileno(), ring_fd), stdin=subprocess.DEVNULL)
                self._transport, _ = await asyncio.get_running_loop().create_unix_connection(
                    lambda: _Replies(self), sock=ours)
            except (OSError, ValueError) as error:
                if ours is not None:
                    ours.close()
                self._lose(f"could not start: {error}")
                return False
            finally:
                if theirs is not None:
                    theirs.close()
                if ring_fd >= 0:
                    os.close(ring_fd)  # the mappings (ours, the signer's) keep the ring
            self._free = list(range(self.chunks))
            self._send(KEY, 0, 0, self.secret.key)
            log.info("frame signer started (pid %d): MACs of frames from %d bytes are computed there",
                     self.process.pid, self.min_frame_bytes)
            return True

    def _send(self, kind: int, chunk: int, job: int, data: bytes = b"", length: int | None = None) -> None:
        if self._transport is None or self._transport.is_closing():
            raise SignerLost(self.lost or "the signer's socket is closed")
        self._transport.write(REQUEST.pack(kind, chunk, job, len(data) if length is None else length) + data)

    async def _feed(self, job: SigningJob, frame: UnsignedFrame) -> None:
        """Hand `frame` to the signer: its head inline, its payload through the ring, its binding inline."""
        self._send(OPEN, 0, job.id)
        self._send(INLINE, 0, job.id, frame.head)
        chunk, filled = -1, 0
        try:
            for part in frame.payload:
                view = memoryview(part).cast("B")
                position = 0
                while position < view.nbytes:
                    if chunk < 0:
                        chunk, filled = await self._take_chunk(), 0
                    n = min(self.chunk_bytes - filled, view.nbytes - position)
                    start = chunk * self.chunk_bytes + filled
                    if self._ring_view is None:
                        raise SignerLost(self.lost or "the ring is released")
                    self._ring_view[start:start + n] = view[position:position + n]
                    filled, position = filled + n, position + n
                    if filled == self.chunk_bytes:
                        self._send(RING, chunk, job.id, length=filled)
                        chunk = -1
            if chunk >= 0:
                self._send(RING, chunk, job.id, length=filled)
                chunk = -1
        finally:
            if chunk >= 0:  # taken, not sent: free again
                self._give_back(chunk)
        self._send(INLINE, 0, job.id, frame.binding)
        self._send(CLOSE, 0, job.id)

    async def _take_chunk(self) -> int:
        if self.lost is not None:
            raise SignerLost(self.lost)
        if self._free:
            return self._free.pop()
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self.stall_timeout_s)
        except TimeoutError:
            self._lose(f"freed no ring chunk for {self.stall_timeout_s:g} s")
            raise SignerLost(self.lost or "") from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give_back(waiter.result())  # handed to us as we were cancelled
            waiter.cancel()
            raise

    def _give_back(self, chunk: int) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(chunk)
                return
        self._free.append(chunk)

    def _on_reply(self, kind: int, chunk: int, job_id: int, tag: bytes) -> None:
        if kind == FREED and 0 <= chunk < self.chunks:
            self._give_back(chunk)
        elif kind == TAG:
            job = self._jobs.pop(job_id, None)
            if job is not None and not job.tag_future.done():
                self.signed += 1
                job.tag_future.set_result(tag[:MAC_BYTES])
        else:
            self._lose(f"sent an unknown reply (kind {kind}, chunk {chunk})")

    def _lose(self, why: str) -> None:
        """The signer is not used any more: say so once, end it, fail what waits on it (signed in process)."""
        if self.lost is not None:
            return
        process = self.process
        code = process.poll() if process is not None else None
        self.lost = why if code is None else f"{why}; exit code {code}"
        if not self._closing:
            log.warning("frame signer%s %s: frame MACs are computed in the controller process from now on",
                        f" (pid {process.pid})" if process is not None else "", self.lost)
        if process is not None and code is None:
            with contextlib.suppress(OSError):
                process.kill()
        if self._transport is not None:
            self._transport.close()
        error = SignerLost(self.lost)
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_exception(error)
        self._waiting.clear()
        for job in self._jobs.values():
            if not job.tag_future.done():
                job.tag_future.set_exception(error)
                job.tag_future.exception()  # (retrieved: a job nobody awaits any more is not "never retrieved")
        self._jobs.clear()
        if self._ring_view is not None:  # (no copy into it is under way: copies never wait)
            self._ring_view.release()
            self._ring_view = None
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    _closing = False

    async def close(self) -> None:
        """End the signer (it exits when its socketpair closes) and release the ring."""
        self._closing = True
        self._lose("closed")
        process = self.process
        if process is not None:
            log.info("frame signer ended: %d frame MACs computed there", self.signed)
            try:
                await asyncio.to_thread(process.wait, 5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)
