"""Requests in flight per engine, and the least-loaded engine with room, in O(log N) per change.

Owns `EngineLoads`: the count of requests each engine holds for the client, and `pick(...)`, the
engine a new batch goes to: the least-loaded engine with room, ties to the smallest URL, one that
failed lately only when no other has room. The order is `min((cooling, load, url))` over the engines
with room; a scan of that kind over every engine cost ~0.4-0.8 ms per batch at 1,024 engines
(benchmarks/bench_scale.py's profile), so the loads sit in a heap with lazy deletion instead: every
change pushes the engine's new `(load, url)` and entries that no longer match are dropped when they
surface. The heap is rebuilt when the engine set changes or stale entries pile up.

Does not own: the concurrency limit, the failure times (engine_client.py passes `cooling`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence


class EngineLoads:
    """Per-engine request counts and the least-loaded pick (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        """URL -> requests in flight there (engines that left the directory may stay here)."""
        self._members: frozenset[str] = frozenset()
        self._member_list: list[str] = []
        self._member_source: tuple[str, ...] | None = None
        """The tuple `_member_list` was last read from (the registry's cached URLs: the same object until a change,
        so a pick at 1,024 engines does not copy and compare 1,024 URLs)."""
        self._heap: list[tuple[int, str]] = []

    def change(self, url: str, delta: int) -> None:
        """`delta` more (or fewer) requests on `url`."""
        count = self.counts.get(url, 0) + delta
        self.counts[url] = count
        if url in self._members:
            heapq.heappush(self._heap, (count, url))
            if len(self._heap) > 4 * len(self._members) + 64:
                self._rebuild()

    def pick(self, urls: Sequence[str], room: int, cooling: Callable[[str], bool]) -> str | None:
        """The engine of `urls` with the fewest requests below `room`, preferring those not `cooling`
        (ties: the smallest URL); None when every engine holds `room` or more."""
        if not (isinstance(urls, tuple) and urls is self._member_source):  # (a tuple cannot have changed)
            if list(urls) != self._member_list:
                self._member_list = list(urls)
                self._members = frozenset(urls)
                self._rebuild()
            self._member_source = urls if isinstance(urls, tuple) else None
        heap, counts = self._heap, self.counts
        set_aside: list[tuple[int, str]] = []
        fallback: str | None = None
        chosen: str | None = None
        while heap:
            load, url = heap[0]
            if counts.get(url, 0) != load:
                heapq.heappop(heap)  # stale: the engine's load changed since this entry
                continue
            if load >= room:
                break
            if not cooling(url):
                chosen = url
                break
            fallback = fallback or url
            set_aside.append(heapq.heappop(heap))
        for entry in set_aside:
            heapq.heappush(heap, entry)
        return chosen or fallback

    def _rebuild(self) -> None:
        self._heap = [(self.counts.get(url, 0), url) for url in self._members]
        heapq.heapify(self._heap)
