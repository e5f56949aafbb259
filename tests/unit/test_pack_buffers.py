"""The train batches' per-token arrays reused across rollouts (controller/train_batches.py `PackBuffers`): packed
bytes identical to fresh arrays, and an array handed back only when nothing sends or reads it any more (the
real TrainerChannel: after every rank reported the command done; never after a failed one)."""

from __future__ import annotations

import asyncio
from array import array

import numpy as np
import pytest

from hpc_rl.controller.registry import Registry, TrainerInfo
from hpc_rl.controller.train_batches import (PackBuffers, RewardShaping, fresh_array, pack_samples,
                                             split_for_data_parallel)
from hpc_rl.controller.trainer_channel import TrainerChannel, TrainerFailed
from hpc_rl.controller.trainers import Trainers
from hpc_rl.data.samples import Sample
from hpc_rl.protocol.messages import CommandDone, TrainCommand

PER_TOKEN = ("tokens", "loss_masks", "rollout_logprobs", "weight_versions")
SHAPING = RewardShaping(advantage_estimator="grpo", n_samples_per_prompt=2)


def sample(index: int, length: int, version: int = 1) -> Sample:
    made = Sample(index=index, group_index=index // 2, prompt="p", prompt_token_ids=[3, 4, index], reward=index % 2)
    made.extend_response(array("q", range(100 + index, 100 + index + length)),
                         array("d", [-0.25 * (index + 1)] * length), array("q", [version]) * length, adopt=True)
    return made


def groups(seed: int, lengths: tuple[int, ...] = (5, 9, 2, 7)) -> list[list[Sample]]:
    samples = [sample(seed * 10 + i, n + seed, version=seed) for i, n in enumerate(lengths)]
    return [samples[i:i + 2] for i in range(0, len(samples), 2)]


def assert_same_batches(got: list[dict[str, np.ndarray]], expected: list[dict[str, np.ndarray]]) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        assert sorted(mine) == sorted(theirs)
        for name in theirs:
            assert mine[name].dtype == theirs[name].dtype, name
            assert mine[name].tobytes() == theirs[name].tobytes(), name  # byte-identical on the wire


def test_leased_batches_are_byte_identical_to_fresh_ones_rollout_after_rollout() -> None:
    buffers = PackBuffers()
    for seed in (1, 3, 2):  # longer, then shorter batches into the same arrays
        lease = buffers.lease()
        got = split_for_data_parallel(groups(seed), SHAPING, 2, lease)
        assert_same_batches(got, split_for_data_parallel(groups(seed), SHAPING, 2))
        lease.release()


def test_an_array_is_reused_only_after_its_lease_is_released() -> None:
    buffers = PackBuffers()
    sending = buffers.lease()
    first = split_for_data_parallel(groups(1), SHAPING, 2, sending)
    kept = [{name: batch[name].copy() for name in PER_TOKEN} for batch in first]
    overlapping = buffers.lease()  # a second set packed while the first is still being sent
    second = split_for_data_parallel(groups(4), SHAPING, 2, overlapping)
    for old, new, copy in zip(first, second, kept):
        for name in PER_TOKEN:
            assert not np.shares_memory(old[name], new[name]), name
            assert np.array_equal(old[name], copy[name]), name  # not overwritten
    sending.release()
    third = split_for_data_parallel(groups(2), SHAPING, 2, buffers.lease())
    for old, new in zip(first, third):
        for name in PER_TOKEN:
            assert np.shares_memory(old[name], new[name]), name  # the released arrays are filled again


def test_a_lease_hands_out_each_array_once() -> None:
    allocate = PackBuffers().lease().allocator(0)
    allocate("tokens", 4, np.int64)
    with pytest.raises(RuntimeError, match="tokens was already handed out"):
        allocate("tokens", 4, np.int64)
    assert fresh_array("tokens", 3, np.float32).dtype == np.float32


def test_pack_samples_fills_what_the_allocator_gives() -> None:
    given: dict[str, np.ndarray] = {}

    def allocate(name: str, size: int, dtype: type) -> np.ndarray:
        given[name] = np.full(size + 3, 77, dtype=dtype)  # dirty memory, longer than asked
        return given[name][:size]

    samples = [s for g in groups(2) for s in g]
    packed = pack_samples(samples, [0.5] * 4, allocate)
    assert sorted(given) == sorted(PER_TOKEN)
    assert_same_batches([packed], [pack_samples(samples, [0.5] * 4)])


def registry() -> Registry:
    made = Registry(trainer_world_size=1, num_engines=1)
    made.add_trainer(TrainerInfo(rank=0, world_size=1, host="h", pid=1, info={"dp_rank": 0, "dp_size": 1}))
    return made


async def rank0(channel: TrainerChannel, seen: list[dict[str, np.ndarray]], buffers: PackBuffers, *,
                fail: bool = False) -> None:
    """A fake rank 0 (no process): takes the next command, keeps its batch, reports it done (or failed)."""
    command = await channel.next_command(0)
    assert isinstance(command, TrainCommand)
    seen.append(command.batch)
    await asyncio.sleep(0.01)
    seen.append({"free while running": np.array(len(buffers._free))})  # checked by the test (no hang if wrong)
    channel.on_done(CommandDone(rank=0, seq=command.seq, ok=not fail, error="boom" if fail else ""))


def test_trainers_reuse_a_batch_s_arrays_only_after_the_ranks_reported_it_done() -> None:
    async def scenario() -> None:
        channel = TrainerChannel(1)
        trainers = Trainers(channel, registry(), shaping=SHAPING, num_rollout=3)
        seen: list[dict[str, np.ndarray]] = []
        rank = asyncio.create_task(rank0(channel, seen, trainers.pack_buffers))
        await trainers.train(0, groups(1), 1)
        await rank
        assert set(trainers.pack_buffers._free) == {(0, name) for name in PER_TOKEN}  # done: given back
        rank = asyncio.create_task(rank0(channel, seen, trainers.pack_buffers))
        await trainers.train(1, groups(2), 2)
        await rank
        assert [int(s["free while running"]) for s in seen[1::2]] == [0, 0]  # in use until the rank reported done
        assert all(np.shares_memory(seen[0][name], seen[2][name]) for name in PER_TOKEN)  # done: reused
        assert_same_batches([seen[2]], split_for_data_parallel(groups(2), SHAPING, 1))

        failing = TrainerChannel(1)
        trainers = Trainers(failing, registry(), shaping=SHAPING, num_rollout=3)
        rank = asyncio.create_task(rank0(failing, seen, trainers.pack_buffers, fail=True))
        with pytest.raises(TrainerFailed):
            await trainers.train(0, groups(1), 1)
        await rank
        assert not trainers.pack_buffers._free  # a failed command's arrays are never handed out again

    asyncio.run(scenario())


def test_new_pack_arrays_are_writable_memory_of_their_own_mapping() -> None:
    """A leased array that is new lives in an anonymous mapping of ordinary pages, not numpy's own (huge-page)
    allocation: the first rollout's page faults (train_batches._small_page_array)."""
    import mmap

    lease = PackBuffers().lease()
    got = lease.allocator(0)("tokens", 1000, np.int64)
    base = got
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base
    assert isinstance(base, mmap.mmap) and got.flags.writeable and len(got) == 1000 and got.dtype == np.int64
    got[:] = 7
    assert int(got.sum()) == 7000
