"""Python producer threads and a consumer thread on one TrajectoryQueue: the blocking calls release
the GIL, so the threads really run at the same time, and every trajectory is delivered once."""

import threading
import time

import numpy as np

import laminar

GROUP = 4


def test_two_producers_and_a_consumer_exactly_once(rng, make_trajectory):
    per_producer = 400
    # Room for a few groups only: producers block in push while the consumer trains, which only
    # makes progress if a blocked push lets go of the GIL.
    q = laminar.TrajectoryQueue(laminar.TrajectoryQueueOptions(capacity_trajectories=3 * GROUP))
    errors = []
    blocked_seen = []

    def produce(p):
        try:
            for i in range(per_producer):
                group = p * per_producer // GROUP + i // GROUP
                tokens = [rng.randrange(0, 1000) for _ in range(1 + i % 17)]
                t = make_trajectory(p * per_producer + i, group_id=group, group_size=GROUP, sample_index=i % GROUP,
                                    response=tokens)
                q.push(t, timeout=10)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    delivered = []
    rewards_sum = [0.0]

    def consume():
        try:
            total = 2 * per_producer
            while len(delivered) < total:
                b = q.pop_batch(laminar.BatchSpec(max_trajectories=2 * GROUP, wait=10))
                assert len(b) % GROUP == 0  # whole groups only
                blocked_seen.append(q.stats()["depth"]["blocked_producers"])
                offsets = b.response_offsets
                logprobs = b.logprobs
                tokens = b.response_tokens
                for i in range(len(b)):
                    want = np.float32([-0.01 * (t % 100) for t in tokens[offsets[i]:offsets[i + 1]]])
                    np.testing.assert_array_equal(logprobs[offsets[i]:offsets[i + 1]], want)
                rewards_sum[0] += float(b.rewards.sum())
                delivered.extend(b.ids.tolist())
                time.sleep(0.001)  # training, with the GIL released
                q.ack(b)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(2)]
    threads.append(threading.Thread(target=consume))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a thread is stuck: a blocking call kept the GIL"
    assert not errors, errors
    assert sorted(delivered) == list(range(2 * per_producer))  # every one, exactly once
    assert rewards_sum[0] == 2 * per_producer * 1.0
    assert max(blocked_seen) > 0, "producers never waited for room: the test did not exercise blocking"
    stats = q.stats()
    assert stats["flow"]["pushed"] == stats["flow"]["acked"] == 2 * per_producer
    assert stats["depth"]["ready"] == 0 and stats["depth"]["leases"] == 0


def test_a_waiting_pop_lets_another_thread_push(make_trajectory, eventually):
    q = laminar.TrajectoryQueue()
    result = {}

    def consume():
        start = time.monotonic()
        try:
            result["ids"] = q.pop_batch(laminar.BatchSpec(max_trajectories=1, wait=10)).ids.tolist()
        except Exception as e:
            result["error"] = e
        result["waited"] = time.monotonic() - start

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert eventually(lambda: q.stats()["depth"]["blocked_consumers"] == 1)  # inside pop_batch now
    # This thread runs while the consumer waits: pop_batch released the GIL.
    q.push(make_trajectory(42))
    consumer.join(timeout=10)
    assert not consumer.is_alive()
    assert "error" not in result, result
    assert result["ids"] == [42]
    assert result["waited"] < 5


def test_close_wakes_blocked_threads(make_trajectory, eventually):
    q = laminar.TrajectoryQueue(laminar.TrajectoryQueueOptions(capacity_trajectories=1))
    q.push(make_trajectory(1))
    outcomes = []

    def blocked_push():
        try:
            q.push(make_trajectory(2))
        except laminar.CancelledError as e:
            outcomes.append(e)

    t = threading.Thread(target=blocked_push)
    t.start()
    assert eventually(lambda: q.stats()["depth"]["blocked_producers"] == 1)
    q.close()
    t.join(timeout=10)
    assert not t.is_alive() and len(outcomes) == 1
