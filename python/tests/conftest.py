"""Shared helpers of the laminar pytest suite."""

import os
import random
import time

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


def wait_until(pred, timeout=10.0):
    """Evaluates pred() until it is true (returns True) or `timeout` seconds pass (returns pred()).
    The pause between evaluations, 1 ms growing to 20 ms, only leaves the cores to the threads
    waited for: the condition is the synchronisation, never the pause."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not pred():
        if time.monotonic() >= deadline:
            return pred()
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


@pytest.fixture
def eventually():
    """The suite's one helper for waiting on a state another thread or process brings about:
    `assert eventually(lambda: q.stats()["depth"]["blocked_consumers"] == 1)`."""
    return wait_until
