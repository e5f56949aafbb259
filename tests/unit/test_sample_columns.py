"""A sample's per-token compact columns (data/samples.py): the list fields read as before, the controller's readers
and the trainer's packing take the arrays, and both forms pack to the same trainer arrays."""

from __future__ import annotations

import copy
import pickle
from array import array

import numpy as np
import pytest

from hpc_rl.controller.logprob_guard import generated_with
from hpc_rl.controller.train_batches import pack_samples
from hpc_rl.data.samples import Sample
from hpc_rl.data.uniform_column import UniformColumn
from hpc_rl.rollout.partial_buffer import reset_sample, trained_token_staleness, version_range
from hpc_rl.rollout.request_fields import weight_version_column
from hpc_rl.rollout.scheduler import _sample_stats


def compact_sample(index: int = 1, versions: tuple[int, ...] = (2, 2, 3)) -> Sample:
    sample = Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[5, 6])
    sample.extend_response(array("q", [10, 11]), array("d", [-0.5, -0.25]), array("q", versions[:2]))
    sample.extend_response([12], [-1.0], versions[2:])
    return sample


def listed_sample(index: int = 1, versions: tuple[int, ...] = (2, 2, 3)) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[5, 6], response_token_ids=[10, 11, 12],
                  response_logprobs=[-0.5, -0.25, -1.0], weight_versions=list(versions))


def test_a_fresh_sample_holds_its_response_as_compact_columns() -> None:
    sample = compact_sample()
    assert "response_token_ids" not in sample.__dict__  # no list made yet
    assert isinstance(sample.column("response_token_ids"), array) and sample.response_length == 3
    assert sample.total_length == 5


def test_reading_a_field_makes_the_list_it_stands_for_once() -> None:
    sample = compact_sample()
    tokens = sample.response_token_ids
    assert type(tokens) is list and tokens == [10, 11, 12]
    assert sample.response_token_ids is tokens  # later reads are the list's
    tokens.append(13)  # and writes too
    assert sample.response_length == 4 and sample.column("response_token_ids") is tokens
    assert isinstance(sample.column("response_logprobs"), array)  # the other columns stay compact
    sample.extend_response([14], [-2.0], [3])  # a mixed sample still extends each field where it is held
    assert sample.response_token_ids == [10, 11, 12, 13, 14] and sample.response_logprobs == [-0.5, -0.25, -1.0, -2.0]


def test_compact_and_listed_samples_are_equal_and_serialise_the_same() -> None:
    assert compact_sample() == listed_sample()
    assert compact_sample().to_dict() == listed_sample().to_dict()
    for clone in (copy.deepcopy(compact_sample()), pickle.loads(pickle.dumps(compact_sample()))):
        assert clone == listed_sample() and clone.weight_versions == [2, 2, 3]


def test_assigning_a_field_replaces_its_column() -> None:
    sample = compact_sample()
    assert reset_sample(sample) == 3
    assert sample.response_token_ids == [] and sample.weight_versions == [] and sample.response_length == 0
    sample.extend_response(array("q", [7]), array("d", [-0.1]), array("q", [4]))  # empty again: compact again
    assert isinstance(sample.column("weight_versions"), array) and sample.weight_versions == [4]


def test_a_missing_attribute_is_still_an_attribute_error() -> None:
    sample = compact_sample()
    try:
        sample.no_such_field  # noqa: B018
    except AttributeError as error:
        assert "no_such_field" in str(error)
    else:
        raise AssertionError("expected AttributeError")


def test_compact_and_listed_samples_pack_to_the_same_trainer_arrays() -> None:
    compact = pack_samples([compact_sample(1), compact_sample(2, (4, 4, 4))], [0.5, -0.5])
    listed = pack_samples([listed_sample(1), listed_sample(2, (4, 4, 4))], [0.5, -0.5])
    assert compact.keys() == listed.keys()
    for name in listed:
        assert compact[name].dtype == listed[name].dtype, name
        np.testing.assert_array_equal(compact[name], listed[name], err_msg=name)
    np.testing.assert_array_equal(compact["tokens"], [5, 6, 10, 11, 12, 5, 6, 10, 11, 12])
    np.testing.assert_array_equal(compact["weight_versions"], [2, 2, 3, 4, 4, 4])


def test_version_readers_take_compact_columns() -> None:
    sample = compact_sample()
    assert version_range(sample.column("weight_versions")) == (2, 3)
    assert trained_token_staleness([sample], 3) == trained_token_staleness([listed_sample()], 3) == (2 / 3, 1.0)
    assert not generated_with([[sample]], 3)
    assert generated_with([[compact_sample(versions=(3, 3, 3))]], 3)
    assert "weight_versions" not in sample.__dict__  # none of them made a list


def test_to_dict_copies_the_token_lists_without_making_a_column_a_list() -> None:
    """The form `dataclasses.asdict` gave (what checkpoints and the partial buffer's state hold), copies that share
    nothing with the sample, and the columns still compact afterwards."""
    from dataclasses import asdict

    sample = compact_sample()
    sample.loss_mask, sample.teacher_logprobs, sample.metadata = [1, 0, 1], [-0.1, -0.2, -0.3], {"tool": {"n": [1]}}
    data = sample.to_dict()
    assert set(sample.compact_columns()) == {"response_token_ids", "response_logprobs", "weight_versions"}
    listed = listed_sample()
    listed.loss_mask, listed.teacher_logprobs, listed.metadata = [1, 0, 1], [-0.1, -0.2, -0.3], {"tool": {"n": [1]}}
    assert data == listed.to_dict() == asdict(listed) | {"status": "pending"}
    assert all(type(data[name]) is list for name in ("response_token_ids", "response_logprobs", "weight_versions",
                                                     "prompt_token_ids", "loss_mask", "teacher_logprobs"))
    data["prompt_token_ids"].append(7)
    data["metadata"]["tool"]["n"].append(2)
    listed.to_dict()["loss_mask"].append(0)
    assert sample.prompt_token_ids == [5, 6] and sample.metadata == {"tool": {"n": [1]}} and listed.loss_mask == [1, 0, 1]


def adopted_sample(index: int = 1, versions: tuple[int, ...] = (2, 2, 3)) -> tuple[Sample, list[array]]:
    given = [array("q", [10, 11]), array("d", [-0.5, -0.25]), array("q", versions[:2])]
    sample = Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[5, 6])
    sample.extend_response(*given, adopt=True)
    sample.extend_response([12], [-1.0], versions[2:])
    return sample, given


def test_a_fresh_sample_adopts_the_arrays_it_is_handed_over() -> None:
    sample, given = adopted_sample()
    for name, values in zip(("response_token_ids", "response_logprobs", "weight_versions"), given):
        assert sample.column(name) is values  # held, not copied (and extended in place by the next answer)
    assert given[0].typecode == "q" and given[1].typecode == "d" and given[2].typecode == "q"
    listed = listed_sample()
    assert sample == listed and sample.to_dict() == listed.to_dict()  # equality and the JSON form unchanged
    assert sample.response_token_ids == [10, 11, 12] and isinstance(sample.response_token_ids, list)  # plug-ins: lists
    assert sample.response_logprobs == [-0.5, -0.25, -1.0] and sample.weight_versions == [2, 2, 3]
    packed, expected = pack_samples([adopted_sample()[0]], [1.0]), pack_samples([listed], [1.0])
    for name in expected:
        assert packed[name].dtype == expected[name].dtype and np.array_equal(packed[name], expected[name]), name


def test_adoption_copies_what_is_not_its_own_or_a_sample_that_has_tokens() -> None:
    shared = array("q", [1, 2])
    sample = Sample(index=1, group_index=0, prompt="p", prompt_token_ids=[5])
    sample.extend_response(shared, array("d", [0.0, 0.0]), shared, adopt=True)  # one array twice: copied
    assert sample.column("response_token_ids") is not shared and sample.column("weight_versions") is not shared
    lists = Sample(index=2, group_index=0, prompt="p", prompt_token_ids=[5])
    lists.extend_response([1], [0.0], [0], adopt=True)  # lists: copied into compact columns
    assert isinstance(lists.column("response_token_ids"), array)
    given = array("q", [7])
    sample.extend_response(given, array("d", [0.5]), array("q", [9]), adopt=True)  # has tokens: appended
    assert sample.column("response_token_ids") is not given and sample.response_token_ids == [1, 2, 7]
    assert sample.weight_versions == [1, 2, 9]


# -- weight versions held as (version, length): data/uniform_column.py ---------------------------------------------

def uniform_sample(index: int = 1, version: int = 4, length: int = 3) -> Sample:
    """What generate.py's `take` makes of an answer generated by one policy."""
    sample = Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[5, 6])
    sample.extend_response(array("q", range(10, 10 + length)), array("d", [-0.5] * length),
                           UniformColumn(version, length), adopt=True)
    return sample


def listed_uniform(index: int = 1, version: int = 4, length: int = 3) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[5, 6],
                  response_token_ids=list(range(10, 10 + length)), response_logprobs=[-0.5] * length,
                  weight_versions=[version] * length)


def test_a_uniform_column_reads_like_the_array_it_stands_for() -> None:
    column, expanded = UniformColumn(7, 4), array("q", [7] * 4)
    assert len(column) == 4 and column[0] == column[-1] == column[3] == 7 and list(column) == [7] * 4
    for bad in (4, -5):
        with pytest.raises(IndexError):
            column[bad]  # noqa: B018
    assert column[1:3] == UniformColumn(7, 2) and column[:9] == column and len(column[5:]) == 0
    assert column.count(7) == 4 and column.count(6) == 0 and UniformColumn(7, 0).count(7) == 0
    assert column.tolist() == expanded.tolist() and type(column.tolist()) is list
    assert column.expanded() == expanded and column.expanded().typecode == "q"
    assert column == expanded and column == [7] * 4 and expanded == column and column != [7, 7, 7, 6]
    assert column != UniformColumn(6, 4) and UniformColumn(6, 0) == UniformColumn(7, 0)
    np.testing.assert_array_equal(np.asarray(column), np.frombuffer(expanded, dtype=np.int64))
    assert np.asarray(column).dtype == np.int64
    for clone in (copy.deepcopy(column), pickle.loads(pickle.dumps(column))):
        assert type(clone) is UniformColumn and clone == column
    with pytest.raises(ValueError, match="length"):
        UniformColumn(1, -1)


def test_an_answer_of_one_version_is_held_as_one_version_and_reads_as_the_same_list() -> None:
    sample = uniform_sample()
    assert sample.column("weight_versions") == UniformColumn(4, 3)
    assert type(sample.column("weight_versions")) is UniformColumn
    assert sample.uniform_weight_version() == 4 and sample.response_length == 3
    assert sample.to_dict() == listed_uniform().to_dict() and sample.uniform_weight_version() == 4
    for clone in (copy.deepcopy(uniform_sample()), pickle.loads(pickle.dumps(uniform_sample()))):
        assert clone.uniform_weight_version() == 4 and clone == listed_uniform()
    versions = sample.weight_versions  # the first read makes the list, as for an array column
    assert type(versions) is list and versions == [4, 4, 4] and sample.weight_versions is versions
    assert sample.uniform_weight_version() is None  # (a list now: plug-ins may change it)
    assert uniform_sample() == listed_uniform()  # (equality reads the fields: lists, as before)
    assert listed_uniform().uniform_weight_version() is None and compact_sample().uniform_weight_version() is None


def test_a_uniform_column_grows_while_one_version_and_becomes_an_array_at_the_second() -> None:
    sample = uniform_sample()
    sample.extend_response(array("q", [20]), array("d", [-1.0]), UniformColumn(4, 1), adopt=True)  # has tokens
    assert sample.column("weight_versions") == UniformColumn(4, 4) and sample.uniform_weight_version() == 4
    sample.extend_response([21, 22], [-1.0, -1.0], UniformColumn(5, 2))
    held = sample.column("weight_versions")
    assert type(held) is array and held.tolist() == [4, 4, 4, 4, 5, 5] and sample.uniform_weight_version() is None
    sample.extend_response([23], [-1.0], UniformColumn(6, 1))  # an array column takes a uniform one's elements
    assert sample.weight_versions == [4, 4, 4, 4, 5, 5, 6]
    mixed = uniform_sample()
    mixed.extend_response([30], [-1.0], [4])  # a list of versions: an array, even of the same version
    assert type(mixed.column("weight_versions")) is array and mixed.weight_versions == [4, 4, 4, 4]
    listed = listed_uniform()
    listed.extend_response([30], [-1.0], UniformColumn(9, 2))  # list fields take its elements
    assert listed.weight_versions == [4, 4, 4, 9, 9]
    fresh = Sample(index=3, group_index=0, prompt="p", prompt_token_ids=[5])
    fresh.extend_response([1, 2], [0.0, 0.0], UniformColumn(2, 2))  # not adopted: still held as it is (immutable)
    assert fresh.uniform_weight_version() == 2 and fresh.response_token_ids == [1, 2]


def test_uniform_and_listed_versions_pack_to_the_same_trainer_arrays() -> None:
    """The trainer receives byte-identical arrays whichever form a sample holds."""
    def forms(index: int) -> list[Sample]:
        array_held = Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[5, 6])
        array_held.extend_response(array("q", [10, 11, 12]), array("d", [-0.5] * 3), array("q", [4] * 3), adopt=True)
        narrow = Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[5, 6])  # as answer workers send
        narrow.extend_response(array("i", [10, 11, 12]), array("f", [-0.5] * 3), UniformColumn(4, 3), adopt=True)
        assert (narrow.column("response_token_ids").typecode, narrow.column("response_logprobs").typecode) == ("i", "f")
        return [uniform_sample(index), listed_uniform(index), array_held, narrow]
    spanning = uniform_sample(9, version=2, length=2)
    spanning.extend_response([12], [-0.5], UniformColumn(3, 1))
    packed = [pack_samples([form, spanning, other], [0.5, -0.5, 0.0])
              for form, other in zip(forms(1), forms(2)[::-1])]
    for arrays in packed[1:]:
        assert arrays.keys() == packed[0].keys()
        for name in arrays:
            assert arrays[name].dtype == packed[0][name].dtype and arrays[name].tobytes() == packed[0][name].tobytes()
    np.testing.assert_array_equal(packed[0]["weight_versions"], [4, 4, 4, 2, 2, 3, 4, 4, 4])


def test_version_readers_take_a_uniform_column_without_making_a_list() -> None:
    samples, listed = [uniform_sample(1), uniform_sample(2, version=2)], [listed_uniform(1), listed_uniform(2, 2)]
    assert version_range(samples[0].column("weight_versions")) == (4, 4)
    assert trained_token_staleness(samples, 5) == trained_token_staleness(listed, 5) == (2.0, 3.0)
    assert _sample_stats([samples], 5) == _sample_stats([listed], 5)
    assert generated_with([[uniform_sample(3)]], 4) and not generated_with([samples], 4)
    masked = uniform_sample(4)
    masked.loss_mask = [1, 0, 0]
    assert trained_token_staleness([masked], 5) == (1.0, 1.0)
    assert all("weight_versions" not in s.__dict__ for s in (*samples, masked))


def test_an_answers_versions_are_one_version_unless_its_spans_differ() -> None:
    assert weight_version_column({"weight_version": "3"}, 4, fallback=0) == UniformColumn(3, 4)
    one_span = {"weight_version": "3", "weight_versions": [{"version": "3", "start": 0, "end": 4}]}
    assert type(weight_version_column(one_span, 4, fallback=0)) is UniformColumn
    other = {"weight_version": "default", "weight_versions": [{"version": "5", "start": 0, "end": 4}]}
    assert weight_version_column(other, 4, fallback=0) == UniformColumn(5, 4)
    two = {"weight_version": "3", "weight_versions": [{"version": "2", "start": 0, "end": 2},
                                                      {"version": "3", "start": 2, "end": 4}]}
    column = weight_version_column(two, 4, fallback=0)
    assert type(column) is array and column.tolist() == [2, 2, 3, 3]
    assert weight_version_column({}, 0, fallback=1) == UniformColumn(1, 0)


def test_compact_columns_give_writers_arrays_or_the_uniform_column_and_hold_columns_takes_it_back() -> None:
    sample = uniform_sample()
    held = sample.compact_columns()
    assert type(held["weight_versions"]) is array and held["weight_versions"].tolist() == [4, 4, 4]
    assert sample.compact_columns(expand_uniform=False)["weight_versions"] == UniformColumn(4, 3)
    assert type(sample.column("weight_versions")) is UniformColumn  # not replaced by the expansion
    stored = Sample(index=1, group_index=0, prompt="p", prompt_token_ids=[5, 6])
    stored.hold_columns({"response_token_ids": array("q", [10, 11, 12]), "response_logprobs": array("d", [-0.5] * 3),
                         "weight_versions": UniformColumn(4, 3)})
    assert stored.uniform_weight_version() == 4 and stored == listed_uniform()
    with pytest.raises(ValueError, match="response_token_ids"):
        stored.hold_columns({"response_token_ids": UniformColumn(1, 3)})


def test_a_uniform_sample_survives_the_journal_as_the_same_sample() -> None:
    from hpc_rl.controller.retained_journal import RetainedBatch

    batch = RetainedBatch(rollout_id=1, weight_version=4, session_id=None, state_before="x", state_after={},
                          groups=[[uniform_sample(1), uniform_sample(2, version=2, length=5)]])
    line, buffers = batch.encode()
    back = RetainedBatch.decode(line + b"".join(bytes(b) for b in buffers))
    # the one-version column is written as its value (no bytes: only the ids and log-probs are stored) and read
    # back as a UniformColumn, not expanded to 8 bytes per token
    assert sum(memoryview(b).nbytes for b in buffers) == sum(
        len(s.column("response_token_ids")) * 4 + len(s.column("response_logprobs")) * 4
        for g in batch.groups for s in g)
    assert all(isinstance(s.compact_columns(expand_uniform=False)["weight_versions"], UniformColumn)
               for g in back.groups for s in g)
    assert back.groups == [[listed_uniform(1), listed_uniform(2, 2, 5)]]
