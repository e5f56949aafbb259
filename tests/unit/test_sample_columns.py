"""A sample's per-token compact columns (data/samples.py): the list fields read as before, the controller's readers
and the trainer's packing take the arrays, and both forms pack to the same trainer arrays."""

from __future__ import annotations

import copy
import pickle
from array import array

import numpy as np

from hpc_rl.controller.logprob_guard import generated_with
from hpc_rl.controller.train_batches import pack_samples
from hpc_rl.data.samples import Sample
from hpc_rl.rollout.partial_buffer import reset_sample, trained_token_staleness, version_range


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
