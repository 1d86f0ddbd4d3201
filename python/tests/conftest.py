"""Shared helpers of the laminar pytest suite."""

import os
import random

import pytest

import laminar


def trajectory(tid, *, version=0, group_id=0, group_size=1, sample_index=0, prompt=(1, 2), response=(3, 4, 5),
               reward=1.0):
    """A valid trajectory whose log-probs are derived from its tokens, so a test can check them."""
    return laminar.Trajectory(id=tid, version=version, group_id=group_id, prompt_id=group_id,
                              group_size=group_size, sample_index=sample_index, prompt_tokens=list(prompt),
                              response_tokens=list(response), logprobs=[-0.01 * (t % 100) for t in response],
                              rewards=[reward])


@pytest.fixture
def make_trajectory():
    return trajectory


@pytest.fixture
def rng():
    """A seeded random.Random; the seed is printed (pytest shows it for a failing test) and can be
    fixed with LAMINAR_TEST_SEED."""
    seed = int(os.environ.get("LAMINAR_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"seed {seed} (LAMINAR_TEST_SEED={seed} repeats it)")
    return random.Random(seed)
