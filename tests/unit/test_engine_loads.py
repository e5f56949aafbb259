"""EngineLoads: the heap pick equals the scan it replaced (min of (cooling, load, url) among engines with room)."""

from __future__ import annotations

import random

from hpc_rl.rollout.engine_loads import EngineLoads


def scan_pick(counts: dict[str, int], urls: list[str], room: int, cooling: set[str]) -> str | None:
    candidates = [(url in cooling, counts.get(url, 0), url) for url in urls if counts.get(url, 0) < room]
    return min(candidates)[2] if candidates else None


def test_pick_matches_the_scan_under_random_changes_and_directory_churn() -> None:
    rng = random.Random(7)
    all_urls = [f"http://10.0.0.{i}:30000" for i in range(40)]
    urls = all_urls[:30]
    loads = EngineLoads()
    cooling: set[str] = set()
    picks = 0
    for step in range(4000):
        action = rng.random()
        if action < 0.4:
            url = loads.pick(urls, room := rng.randint(1, 6), cooling.__contains__)
            assert url == scan_pick(loads.counts, urls, room, cooling), step
            if url is not None:
                loads.change(url, rng.randint(1, 3))
                picks += 1
        elif action < 0.8:
            busy = [u for u, n in loads.counts.items() if n > 0]
            if busy:
                loads.change(rng.choice(busy), -1)
        elif action < 0.9:
            cooling ^= {rng.choice(all_urls)}
        else:  # engines die and come back: the directory changes
            urls = sorted(rng.sample(all_urls, rng.randint(0, 40)))
    assert picks > 500


def test_a_cooling_engine_is_picked_only_when_no_other_has_room() -> None:
    loads = EngineLoads()
    urls = ["a", "b"]
    assert loads.pick(urls, 2, {"a"}.__contains__) == "b"
    loads.change("b", 2)
    assert loads.pick(urls, 2, {"a"}.__contains__) == "a"
    loads.change("a", 2)
    assert loads.pick(urls, 2, {"a"}.__contains__) is None


def test_stale_entries_do_not_pile_up() -> None:
    loads = EngineLoads()
    urls = [f"u{i}" for i in range(8)]
    loads.pick(urls, 10, lambda url: False)
    for _ in range(10_000):
        loads.change("u3", 1)
        loads.change("u3", -1)
    assert len(loads._heap) <= 4 * len(urls) + 64
    assert loads.pick(urls, 10, lambda url: False) == "u0"
