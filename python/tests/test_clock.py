"""laminar.Clock and ManualClock: queue leases, group timeouts and waits in virtual time."""

import threading
import time

import pytest

import laminar


def test_steady_clock_moves():
    clock = laminar.Clock.steady()
    a = clock.now()
    time.sleep(0.01)
    assert clock.now() - a >= 0.009


def test_manual_clock_moves_only_when_told():
    clock = laminar.ManualClock(start=5)
    assert isinstance(clock, laminar.Clock)
    assert clock.now() == 5.0
    clock.advance(1.5)
    assert clock.now() == 6.5
    clock.set(10)
    assert clock.now() == 10.0
    with pytest.raises(laminar.InvalidArgumentError):
        clock.set(9)
    with pytest.raises(laminar.InvalidArgumentError, match="seconds"):
        clock.advance(-1)
    with pytest.raises(laminar.InvalidArgumentError):
        clock.advance(None)  # infinity
    assert clock.now() == 10.0
    assert laminar.ManualClock().now() == 0.0


def test_options_take_a_clock():
    clock = laminar.ManualClock()
    for options in (laminar.TrajectoryQueueOptions(clock=clock), laminar.TransportOptions(clock=clock),
                    laminar.TrajectoryQueueServerOptions(clock=clock), laminar.RemoteProducerOptions(clock=clock)):
        assert options.clock is clock
        options.clock = None
        assert options.clock is None
    with pytest.raises(TypeError):
        laminar.TrajectoryQueueOptions(clock="steady")


def test_lease_and_group_timeout_in_virtual_time(make_trajectory):
    clock = laminar.ManualClock()
    q = laminar.TrajectoryQueue(laminar.TrajectoryQueueOptions(clock=clock, default_lease=60, group_timeout=30))
    q.push(make_trajectory(1))
    b = q.pop_batch(laminar.BatchSpec(max_trajectories=1))
    assert b.lease_deadline == 60.0
    clock.advance(59)
    q.nack(b)  # still leased
    b = q.pop_batch(laminar.BatchSpec(max_trajectories=1))
    clock.advance(61)
    with pytest.raises(laminar.AbortedError):
        q.ack(b)

    q.push(make_trajectory(2, group_id=9, group_size=3, sample_index=0))
    with pytest.raises(laminar.UnavailableError):
        q.pop_batch(laminar.BatchSpec(max_trajectories=5, min_trajectories=2))
    clock.advance(30)
    b = q.pop_batch(laminar.BatchSpec(max_trajectories=5))
    assert sorted(b.ids.tolist()) == [1, 2]
    assert b.partial_group.tolist() == [x == 2 for x in b.ids.tolist()]


def test_a_wait_ends_when_the_clock_is_moved(make_trajectory, eventually):
    clock = laminar.ManualClock()
    q = laminar.TrajectoryQueue(laminar.TrajectoryQueueOptions(clock=clock))
    result = {}

    def consume():
        try:
            q.pop_batch(laminar.BatchSpec(max_trajectories=1, wait=5))
        except laminar.Error as e:
            result["error"] = e
            result["at"] = clock.now()

    t = threading.Thread(target=consume)
    t.start()
    assert eventually(lambda: q.stats()["depth"]["blocked_consumers"] == 1)
    # One virtual second at a time: each jump wakes the consumer, which ends its wait only at 5.
    for _ in range(10):
        t.join(timeout=0.01)
        if not t.is_alive():
            break
        clock.advance(1)
    t.join(timeout=10)
    assert not t.is_alive()
    assert type(result["error"]) is laminar.DeadlineExceededError
    assert result["at"] >= 5
