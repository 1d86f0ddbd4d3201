"""TrajectoryQueueServer, RemoteProducer and Transport: pushes from other transports and other
processes reach the queue with the queue's own answers."""

import os
import subprocess
import sys
import threading

import pytest

import laminar

TOKEN = b"laminar python test token 0123"


def transport(**overrides):
    return laminar.Transport(laminar.TransportOptions(cluster_token=TOKEN, **overrides))


@pytest.fixture
def served():
    """A queue served on a listening transport: (queue, server, address, server transport)."""
    t = transport()
    address = t.listen("127.0.0.1")
    q = laminar.TrajectoryQueue(laminar.TrajectoryQueueOptions(capacity_trajectories=64))
    server = laminar.TrajectoryQueueServer(t, q, laminar.TrajectoryQueueServerOptions(credits_per_producer=4))
    return q, server, address, t


def test_transport_options_and_listen():
    o = laminar.TransportOptions(cluster_token="s" * 16, ucx_transports="tcp", max_message_bytes=1 << 20,
                                 connect_timeout=2.0, handshake_timeout=1.0, max_unauthenticated_connections=8,
                                 operation_timeout=3.0, idle_timeout=None, max_inbox_bytes_per_connection=1024,
                                 max_inbox_bytes=4096)
    assert o.cluster_token == b"s" * 16 and o.ucx_transports == "tcp" and o.max_message_bytes == 1 << 20
    assert (o.connect_timeout, o.handshake_timeout, o.operation_timeout) == (2.0, 1.0, 3.0)
    assert o.idle_timeout == float("inf") and o.max_unauthenticated_connections == 8
    assert (o.max_inbox_bytes_per_connection, o.max_inbox_bytes) == (1024, 4096)
    t = laminar.Transport(o)
    assert t.listen_address() is None
    address = t.listen("127.0.0.1", 0)
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert t.listen_address() == address
    assert t.options.cluster_token == b"s" * 16
    assert t.stats()["inbox_messages"] == 0


def test_transport_bad_input():
    with pytest.raises(laminar.InvalidArgumentError, match="cluster_token"):
        laminar.Transport(laminar.TransportOptions(cluster_token=b"short"))
    with pytest.raises(laminar.InvalidArgumentError, match="cluster_token must be bytes or str"):
        laminar.TransportOptions(cluster_token=123)
    with pytest.raises(laminar.InvalidArgumentError, match="port"):
        transport().listen("127.0.0.1", 70000)


def test_producer_gets_the_queues_answers(served, make_trajectory):
    q, server, address, _ = served
    producer = laminar.RemoteProducer(transport(), address,
                                      laminar.RemoteProducerOptions(connect_timeout=10, stall_timeout=10))
    assert producer.credits_granted == 4 and producer.credits_free == 4
    producer.push(make_trajectory(1))
    with pytest.raises(laminar.AlreadyExistsError, match="1"):
        producer.push(make_trajectory(1))
    bad = make_trajectory(2)
    bad.logprobs = [-1.0]  # one log-prob for three response tokens
    with pytest.raises(laminar.InvalidArgumentError, match="logprobs"):
        producer.push(bad)
    result = producer.push_many([make_trajectory(3), make_trajectory(1), make_trajectory(4)])
    assert result[0] is None and type(result[1]) is laminar.AlreadyExistsError and result[2] is None
    b = q.pop_batch(laminar.BatchSpec(max_trajectories=10))
    assert b.ids.tolist() == [1, 3, 4]
    assert b[1] == make_trajectory(3)
    stats = server.stats()
    # The producer refuses the invalid trajectory itself; the duplicates are the queue's answers.
    assert stats["producers"] == 1 and stats["received"] == 3 and stats["accepted"] == 3
    assert stats["refused"] == 2 and stats["malformed"] == 0
    assert producer.credits_free == 4


def test_producer_bad_input(served):
    q, _, address, server_transport = served
    with pytest.raises(laminar.InvalidArgumentError, match="transport"):
        laminar.RemoteProducer(None, address)
    with pytest.raises(laminar.InvalidArgumentError):
        laminar.RemoteProducer(transport(), address, laminar.RemoteProducerOptions(connect_timeout=0))
    with pytest.raises(laminar.InvalidArgumentError, match="queue"):
        laminar.TrajectoryQueueServer(server_transport, None)
    with pytest.raises(laminar.InvalidArgumentError):
        laminar.TrajectoryQueueServer(transport(), q, laminar.TrajectoryQueueServerOptions(credits_per_producer=0))
    with pytest.raises(laminar.Error):  # nothing listens there
        laminar.RemoteProducer(transport(), "127.0.0.1:1", laminar.RemoteProducerOptions(connect_timeout=2))
    wrong = laminar.Transport(laminar.TransportOptions(cluster_token=b"another token of the cluster"))
    with pytest.raises(laminar.Error):
        laminar.RemoteProducer(wrong, address, laminar.RemoteProducerOptions(connect_timeout=2))


def test_a_dropped_server_fails_pushes(make_trajectory):
    t = transport()
    address = t.listen("127.0.0.1")
    q = laminar.TrajectoryQueue()
    server = laminar.TrajectoryQueueServer(t, q)
    producer = laminar.RemoteProducer(transport(), address)
    producer.push(make_trajectory(1))
    del server
    with pytest.raises(laminar.Error):
        producer.push(make_trajectory(2), timeout=5)
    assert q.stats()["flow"]["pushed"] == 1


CHILD = """
import sys, threading
import laminar
address, token, first, count = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
producer = laminar.RemoteProducer(laminar.Transport(laminar.TransportOptions(cluster_token=token)), address)
def push(start, stop):
    for i in range(start, stop):
        producer.push(laminar.Trajectory(id=i, response_tokens=[i % 1000, 7], logprobs=[-0.5, -0.25],
                                         rewards=[float(i)]), timeout=30)
half = first + count // 2
threads = [threading.Thread(target=push, args=(first, half)), threading.Thread(target=push, args=(half, first + count))]
for t in threads: t.start()
for t in threads: t.join()
print("pushed", count)
"""


def test_producer_processes_and_a_consumer_exactly_once(served):
    q, server, address, _ = served
    per_child = 150
    children = [subprocess.Popen([sys.executable, "-c", CHILD, address, TOKEN.decode(), str(c * per_child),
                                  str(per_child)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=os.environ)
                for c in range(2)]
    try:
        seen = []
        while len(seen) < 2 * per_child:
            b = q.pop_batch(laminar.BatchSpec(max_trajectories=16, wait=30))
            assert b.rewards.tolist() == [float(i) for i in b.ids.tolist()]
            assert b.response_tokens[::2].tolist() == [i % 1000 for i in b.ids.tolist()]
            seen.extend(b.ids.tolist())
            q.ack(b)
        for child in children:
            out, err = child.communicate(timeout=30)
            assert child.returncode == 0, err
            assert out.strip() == f"pushed {per_child}"
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert sorted(seen) == list(range(2 * per_child))
    assert server.stats()["producers"] == 2 and server.stats()["accepted"] == 2 * per_child
