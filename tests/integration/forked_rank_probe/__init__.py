"""A rank module for tests/integration/test_forked_ranks.py: says where its imports were done."""

preloaded_in: int | None = None
"""The process that ran `__main__.preload()` (None: nobody did)."""
