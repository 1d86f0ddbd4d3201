"""laminar.Trajectory: fields from lists, NumPy arrays and torch tensors; bad input; the encoding."""

import copy

import numpy as np
import pytest
import torch

import laminar


def test_fields_from_lists_read_back_as_numpy():
    t = laminar.Trajectory(id=7, prompt_id=8, group_id=9, group_size=4, sample_index=3, version=2,
                           prompt_tokens=[1, 2], response_tokens=(5, 6, 7), logprobs=[-0.5, -1, -0.25],
                           rewards=[1, 0.5], finish_reason=laminar.FinishReason.LENGTH,
                           generation_start_ns=10, generation_end_ns=20, metadata='{"k": 1}')
    assert (t.id, t.prompt_id, t.group_id, t.group_size, t.sample_index, t.version) == (7, 8, 9, 4, 3, 2)
    assert t.prompt_tokens.dtype == np.int32 and t.prompt_tokens.tolist() == [1, 2]
    assert t.response_tokens.dtype == np.int32 and t.response_tokens.tolist() == [5, 6, 7]
    assert t.logprobs.dtype == np.float32 and t.logprobs.tolist() == [-0.5, -1.0, -0.25]
    assert t.rewards.dtype == np.float32 and t.rewards.tolist() == [1.0, 0.5]
    assert t.finish_reason == laminar.FinishReason.LENGTH
    assert (t.generation_start_ns, t.generation_end_ns, t.metadata) == (10, 20, '{"k": 1}')
    assert t.num_tokens == 5
    t.validate()
    assert "id=7" in repr(t)


def test_setters_take_numpy_and_torch():
    t = laminar.Trajectory()
    for tokens in (np.array([3, 4], dtype=np.int64), np.array([3, 4], dtype=np.uint16),
                   torch.tensor([3, 4], dtype=torch.int32), torch.tensor([9, 3, 8, 4])[1::2]):
        t.response_tokens = tokens
        assert t.response_tokens.tolist() == [3, 4]
    for values in (np.array([-0.5, -0.25], dtype=np.float64), torch.tensor([-0.5, -0.25]),
                   torch.tensor([-0.5, -0.25], dtype=torch.float16)):
        t.logprobs = values
        assert t.logprobs.tolist() == [-0.5, -0.25]
    t.rewards = np.float32([2.5])
    assert t.rewards.tolist() == [2.5]
    t.id, t.version, t.group_size = 2**64 - 1, 5, 2
    assert (t.id, t.version, t.group_size) == (2**64 - 1, 5, 2)


def test_read_back_arrays_are_copies():
    t = laminar.Trajectory(response_tokens=[1, 2])
    a = t.response_tokens
    a[0] = 99
    assert t.response_tokens.tolist() == [1, 2]


@pytest.mark.parametrize("field,value,fragment", [
    ("response_tokens", np.array([1.5, 2.0]), "integer dtype"),
    ("response_tokens", torch.tensor([1.0]), "integer dtype"),
    ("prompt_tokens", [1, 2.5], "prompt_tokens[1] must be an int"),
    ("prompt_tokens", ["a"], "must be an int"),
    ("response_tokens", np.zeros((2, 2), dtype=np.int32), "1-D"),
    ("response_tokens", np.int32(4), "of ints, got int32"),
    ("response_tokens", [2**31], "does not fit int32"),
    ("response_tokens", np.array([2**40]), "does not fit int32"),
    ("response_tokens", "123", "list, tuple, NumPy array or torch tensor"),
    ("logprobs", np.array([1, 2]), "floating dtype"),
    ("logprobs", torch.zeros(2, 1), "1-D"),
    ("logprobs", ["x"], "logprobs[0] must be a number"),
    ("logprobs", torch.zeros(2, requires_grad=True), "DLPack"),
    ("rewards", {1.0}, "list, tuple, NumPy array or torch tensor"),
    ("group_size", -1, "group_size"),
    ("group_size", 2**32, "group_size"),
    ("sample_index", 1.0, "sample_index must be an int"),
    ("prompt_id", -1, "prompt id -1 is out of range"),
    ("group_id", 2**64, "group id"),
    ("generation_start_ns", 2**63, "int64"),
    ("id", -1, "trajectory id -1 is out of range"),
    ("version", 2**64, "version"),
])
def test_bad_field_values_raise_invalid_argument(field, value, fragment):
    t = laminar.Trajectory(response_tokens=[1], logprobs=[-1.0], rewards=[0.0])
    with pytest.raises(laminar.InvalidArgumentError) as info:
        setattr(t, field, value)
    assert fragment in str(info.value), str(info.value)
    with pytest.raises(laminar.InvalidArgumentError):
        laminar.Trajectory(**{field: value})
    # The failed assignment left the field as it was.
    assert t.response_tokens.tolist() == [1] and t.logprobs.tolist() == [-1.0]


# contents: whether only the checks that read the arrays (validate(contents=True)) find it.
@pytest.mark.parametrize("kwargs,fragment,contents", [
    (dict(response_tokens=[1, 2], logprobs=[-1.0], rewards=[1.0]), "logprobs", False),
    (dict(response_tokens=[1], logprobs=[-1.0], rewards=[]), "reward", False),
    (dict(response_tokens=[1], logprobs=[-1.0], rewards=[1.0], group_size=2, sample_index=2), "sample_index", False),
    (dict(response_tokens=[-1], logprobs=[-1.0], rewards=[1.0]), "-1", True),
    (dict(response_tokens=[1], logprobs=[float("nan")], rewards=[1.0]), "log-prob", True),
    (dict(response_tokens=[1], logprobs=[-1.0], rewards=[1.0], metadata="[1]"), "metadata", True),
])
def test_validate_names_what_is_wrong(kwargs, fragment, contents):
    t = laminar.Trajectory(**kwargs)
    with pytest.raises(laminar.InvalidArgumentError) as info:
        t.validate()
    assert fragment in str(info.value), str(info.value)
    if contents:
        t.validate(contents=False)
    else:
        with pytest.raises(laminar.InvalidArgumentError):
            t.validate(contents=False)


def test_encode_decode_round_trip(make_trajectory):
    t = make_trajectory(5, version=3, group_id=2, group_size=2, sample_index=1)
    t.metadata = '{"a": [1, 2]}'
    data = t.encode()
    assert isinstance(data, bytes)
    back = laminar.Trajectory.decode(data)
    assert back == t
    assert back != make_trajectory(6)
    with pytest.raises(laminar.DataLossError):
        laminar.Trajectory.decode(data + b"\0")
    bad = laminar.Trajectory(response_tokens=[-3], logprobs=[-1.0], rewards=[1.0])
    assert laminar.Trajectory.decode(bad.encode(), contents=False) == bad
    with pytest.raises(laminar.InvalidArgumentError):
        laminar.Trajectory.decode(bad.encode())


def test_copies_are_independent(make_trajectory):
    t = make_trajectory(1)
    for c in (copy.copy(t), copy.deepcopy(t)):
        assert c == t
        c.response_tokens = [9]
        assert c != t
