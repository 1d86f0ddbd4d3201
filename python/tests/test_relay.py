"""RelayStore and WeightPuller: publish from torch tensors and NumPy arrays through DLPack, pull
into other tensors in place, bytes compared; bad tensors and versions refused."""

import threading

import numpy as np
import pytest
import torch

import laminar


def weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 64, generator=g),
        "norm": torch.randn(64, generator=g).to(torch.bfloat16),
        "proj": torch.randn(64, 48, generator=g).to(torch.float16),
        "ids": torch.randint(0, 1 << 30, (33,), generator=g, dtype=torch.int32),
        "steps": np.arange(7, dtype=np.int64) * (seed + 1),
        "mask": np.frombuffer(bytes(range(200)), dtype=np.uint8).copy(),
    }


def raw(t):
    return (t.numpy() if isinstance(t, torch.Tensor) and t.dtype != torch.bfloat16
            else t.view(torch.int16).numpy() if isinstance(t, torch.Tensor) else t).tobytes()


def empty_like(w):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else np.zeros_like(v) for k, v in w.items()}


def store(**options):
    return laminar.RelayStore(laminar.RelayStoreOptions(chunk_bytes=4096, **options))


def test_publish_acquire_and_pull_in_place():
    s = store()
    assert s.newest_version() is None
    with pytest.raises(laminar.NotFoundError):
        s.acquire()
    w = weights(1)
    s.publish(1, w)
    s.wait_for_version(1, timeout=10)
    assert s.newest_version() == 1
    h = s.acquire()
    assert h.version == 1
    assert [t["name"] for t in h.manifest["tensors"]] == list(w)
    assert [t["dtype"] for t in h.manifest["tensors"]] == ["f32", "bf16", "f16", "i32", "i64", "u8"]
    for name, t in w.items():
        stored = h.tensor_bytes(name)
        assert stored.dtype == np.uint8 and not stored.flags.writeable
        assert stored.tobytes() == raw(t)
    h.verify()
    assert s.stats()["versions_held"] == 1

    puller = laminar.WeightPuller(s)
    assert puller.current_version() is None and puller.newest_version() == 1
    assert puller.next_action(False) == (laminar.PullAction.PULL, 1)
    assert puller.next_action(True) == (laminar.PullAction.NONE, None)
    dst = empty_like(w)
    addresses = {k: v.data_ptr() for k, v in dst.items() if isinstance(v, torch.Tensor)}
    puller.pull(1, dst)
    for name in w:
        assert raw(dst[name]) == raw(w[name]), name
    assert {k: v.data_ptr() for k, v in dst.items() if isinstance(v, torch.Tensor)} == addresses
    assert puller.current_version() == 1 and puller.stopped_pull() is None
    assert puller.next_action(False) == (laminar.PullAction.NONE, None)

    w2 = weights(2)
    s.publish(2, w2)
    s.wait_for_version(2, timeout=10)
    shard = {"proj": torch.zeros(64, 48, dtype=torch.float16), "steps": np.zeros(7, np.int64)}
    laminar.WeightPuller(s, laminar.WeightPullerOptions(verify_checksums=True)).pull(2, shard)
    assert raw(shard["proj"]) == raw(w2["proj"]) and raw(shard["steps"]) == raw(w2["steps"])
    assert s.acquire(1).version == 1  # a handle holds version 1


def test_bytes_outlive_the_handle_and_the_store():
    s = store()
    w = weights(3)
    s.publish(1, w)
    s.wait_for_version(1, timeout=10)
    stored = s.acquire().tensor_bytes("embed")
    del s
    assert stored.tobytes() == raw(w["embed"])


@pytest.mark.parametrize("tensors,error,fragment", [
    ({}, laminar.InvalidArgumentError, "empty"),
    ([torch.zeros(4)], laminar.InvalidArgumentError, "dict"),
    ({1: torch.zeros(4)}, laminar.InvalidArgumentError, "names must be str"),
    ({"": torch.zeros(4)}, laminar.InvalidArgumentError, "name"),
    ({"w": [1.0, 2.0]}, laminar.InvalidArgumentError, "__dlpack__"),
    ({"w": torch.zeros(4, 4).t()}, laminar.InvalidArgumentError, "dense"),
    ({"w": torch.zeros(4, dtype=torch.float64)}, laminar.InvalidArgumentError, "dtype"),
    ({"w": torch.zeros(4, requires_grad=True)}, laminar.InvalidArgumentError, "require gradient"),
])
def test_bad_publishes_are_refused(tensors, error, fragment):
    s = store()
    with pytest.raises(error) as info:
        s.publish(1, tensors)
    assert fragment in str(info.value), str(info.value)
    assert s.newest_version() is None
    s.publish(1, {"w": torch.zeros(4)})  # the refused version was not spent


def test_versions_only_move_forward():
    s = store()
    s.publish(5, {"w": torch.ones(4)})
    for v in (5, 4):
        with pytest.raises(laminar.InvalidArgumentError, match="increase"):
            s.publish(v, {"w": torch.ones(4)})
    with pytest.raises(laminar.InvalidArgumentError, match="version -1"):
        s.publish(-1, {"w": torch.ones(4)})
    with pytest.raises(laminar.DeadlineExceededError, match="6"):
        s.wait_for_version(6, timeout=0.05)
    with pytest.raises(laminar.NotFoundError):
        s.acquire(3)


def test_memory_budget():
    s = store(memory_budget_bytes=8192)
    with pytest.raises(laminar.ResourceExhaustedError):
        s.publish(1, {"w": torch.zeros(1 << 16)})


@pytest.mark.parametrize("destinations,has_live,error,fragment", [
    ({"embed": torch.zeros(300, 63)}, False, laminar.InvalidArgumentError, "shape"),
    ({"embed": torch.zeros(300, 64, dtype=torch.float16)}, False, laminar.InvalidArgumentError, "dtype"),
    ({"embed": torch.zeros(64, 300).t()}, False, laminar.InvalidArgumentError, "dense"),
    ({"nope": torch.zeros(3)}, False, laminar.NotFoundError, "nope"),
    ({}, False, laminar.InvalidArgumentError, "destination"),
    ({"embed": torch.zeros(300, 64)}, True, laminar.FailedPreconditionError, "live trajectory"),
])
def test_bad_pulls_leave_destinations_untouched(destinations, has_live, error, fragment):
    s = store()
    s.publish(1, weights(4))
    s.wait_for_version(1, timeout=10)
    puller = laminar.WeightPuller(s)
    before = {k: v.clone() for k, v in destinations.items()}
    with pytest.raises(error) as info:
        puller.pull(1, destinations, has_live)
    assert fragment in str(info.value), str(info.value)
    assert all(torch.equal(destinations[k], before[k]) for k in destinations)
    assert puller.current_version() is None
    with pytest.raises(laminar.NotFoundError, match="2"):
        puller.pull(2, {"embed": torch.zeros(300, 64)})


def test_prefetch_then_swap_and_cancel():
    s = store()
    w = weights(5)
    s.publish(1, w)
    s.wait_for_version(1, timeout=10)
    idle = laminar.WeightPuller(s)
    with pytest.raises(laminar.FailedPreconditionError):
        idle.prefetch(1)
    puller = laminar.WeightPuller(s, laminar.WeightPullerOptions(policy=laminar.PullPolicy.PREFETCH_THEN_SWAP,
                                                                 copy_chunk_bytes=4096))
    assert puller.next_action(True) == (laminar.PullAction.PREFETCH, 1)
    puller.prefetch(1)
    assert puller.prefetched_version() == 1
    dst = {"embed": torch.zeros(300, 64)}
    with pytest.raises(laminar.FailedPreconditionError):
        puller.swap(dst, True)
    puller.swap(dst)
    assert torch.equal(dst["embed"], w["embed"]) and puller.current_version() == 1
    assert puller.prefetched_version() is None
    puller.cancel()  # no pull running: lost, as documented
    other = {"embed": torch.zeros(300, 64)}
    puller.pull(1, other)
    assert torch.equal(other["embed"], w["embed"])
    with pytest.raises(laminar.InvalidArgumentError):
        laminar.WeightPuller(s, laminar.WeightPullerOptions(copy_chunk_bytes=100))
    with pytest.raises(laminar.InvalidArgumentError, match="relay"):
        laminar.WeightPuller(None)


def test_pull_and_publishes_on_two_threads():
    """Pulls on one thread (the GIL released) while this one publishes newer versions: the pulled
    version stays intact."""
    s = store()
    big = {"w": torch.randn(1 << 21)}
    s.publish(1, big)
    s.wait_for_version(1, timeout=10)
    # The handle keeps version 1 held whether the pulls start before or after the newer publishes.
    held = s.acquire(1)
    dst = {"w": torch.zeros(1 << 21)}
    errors = []

    def pull():
        try:
            for _ in range(5):
                laminar.WeightPuller(s).pull(1, dst)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=pull)
    t.start()
    for v in range(2, 6):
        s.publish(v, {"w": torch.full((1 << 21,), float(v))})
    t.join(timeout=60)
    assert not t.is_alive() and not errors, errors
    assert torch.equal(dst["w"], big["w"])
    del held


PULLER_CHILD = """
import hashlib, sys
import numpy as np, torch
import laminar
socket_path, version = sys.argv[1], int(sys.argv[2])
puller = laminar.WeightPuller.local([socket_path])
assert puller.newest_version() == version
dst = {"embed": torch.zeros(300, 64), "norm": torch.zeros(64, dtype=torch.bfloat16),
       "proj": torch.zeros(64, 48, dtype=torch.float16)}
action, v = puller.next_action(False)
assert (action, v) == (laminar.PullAction.PULL, version), (action, v)
puller.pull(version, dst)
h = hashlib.sha256()
for name in ("embed", "norm", "proj"):
    h.update(dst[name].view(torch.int16 if dst[name].dtype == torch.bfloat16 else dst[name].dtype).numpy().tobytes())
print(puller.current_version(), puller.relay(), h.hexdigest())
"""


def test_pull_in_another_process_through_a_local_relay(tmp_path, eventually):
    import hashlib
    import subprocess
    import sys

    s = laminar.RelayStore(laminar.RelayStoreOptions(chunk_bytes=4096, shareable=True))
    socket_path = str(tmp_path / "relay.sock")
    server = laminar.LocalRelayServer(s, socket_path, laminar.LocalRelayServerOptions(idle_timeout=30))
    assert server.socket_path == socket_path
    with pytest.raises(laminar.AlreadyExistsError):
        laminar.LocalRelayServer(s, socket_path)
    with pytest.raises(laminar.FailedPreconditionError):
        laminar.LocalRelayServer(store(), str(tmp_path / "other.sock"))
    w = weights(7)
    s.publish(3, w)
    s.wait_for_version(3, timeout=10)
    child = subprocess.Popen([sys.executable, "-c", PULLER_CHILD, socket_path, "3"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    version, relay, digest = out.split()
    assert relay == socket_path
    expected = hashlib.sha256()
    for name in ("embed", "norm", "proj"):
        expected.update(raw(w[name]))
    assert (int(version), digest) == (3, expected.hexdigest())
    stats = server.stats()
    assert stats["grants"] >= 1 and server.background_error() is None
    events = []

    def released():
        events.extend(server.events())
        return any(e.kind == laminar.LocalRelayEvent.Kind.RELEASED for e in events)

    assert eventually(released)  # the release arrives when the server sees the child's socket close
    granted = [e for e in events if e.kind == laminar.LocalRelayEvent.Kind.GRANTED]
    assert granted and all(e.version == 3 and e.client_pid == child.pid for e in granted)
    assert any(e.kind == laminar.LocalRelayEvent.Kind.RELEASED and e.client_pid == child.pid for e in events)
    del server
    with pytest.raises(laminar.Error):
        laminar.WeightPuller.local([socket_path],
                                   laminar.WeightPullerOptions(relay_timeout=1)).pull(3, {"embed": torch.zeros(300, 64)})
    with pytest.raises(laminar.InvalidArgumentError):
        laminar.WeightPuller.local([])


CHAIN_CHILD = """
import hashlib, sys
import torch
import laminar
upstreams, version = sys.argv[1].split(","), int(sys.argv[2])
transport = laminar.Transport(laminar.TransportOptions(cluster_token=b"laminar relay chain test token"))
store = laminar.RelayStore()
node = laminar.RelayNode(transport, store, laminar.RelayNodeOptions(upstreams=upstreams, stall_timeout=30))
store.wait_for_version(version, timeout=60)
dst = {"embed": torch.zeros(300, 64), "proj": torch.zeros(64, 48, dtype=torch.float16)}
laminar.WeightPuller(store).pull(version, dst)
digest = hashlib.sha256(dst["embed"].numpy().tobytes() + dst["proj"].numpy().tobytes()).hexdigest()
print(node.upstream(), node.address(), digest)
"""


def test_a_relay_chain_into_another_process(eventually):
    import hashlib
    import subprocess
    import sys

    options = laminar.TransportOptions(cluster_token=b"laminar relay chain test token")
    head_transport, middle_transport = laminar.Transport(options), laminar.Transport(options)
    head_address = head_transport.listen("127.0.0.1")
    middle_address = middle_transport.listen("127.0.0.1")
    head_store, middle_store = store(), laminar.RelayStore()
    head = laminar.RelayNode(head_transport, head_store)
    middle = laminar.RelayNode(middle_transport, middle_store,
                               laminar.RelayNodeOptions(upstreams=[head_address], window=2, connect_timeout=5,
                                                        retry_interval=0.01, stall_timeout=30))
    assert head.address() == head_address and head.upstream() is None
    with pytest.raises(laminar.AlreadyExistsError):
        laminar.RelayNode(head_transport, head_store)
    with pytest.raises(laminar.InvalidArgumentError):
        laminar.RelayNode(laminar.Transport(options), store(), laminar.RelayNodeOptions(window=0))
    w = weights(9)
    head_store.publish(4, {"embed": w["embed"], "proj": w["proj"]})
    middle_store.wait_for_version(4, timeout=30)
    # The head may send the version before the middle's subscribe call has returned to note its upstream.
    assert eventually(lambda: middle.upstream() == head_address)
    child = subprocess.run([sys.executable, "-c", CHAIN_CHILD, f"{middle_address},{head_address}", "4"],
                           capture_output=True, text=True, timeout=90)
    assert child.returncode == 0, child.stderr
    upstream, address, digest = child.stdout.split()
    assert (upstream, address) == (middle_address, "None")  # a leaf: its transport does not listen
    assert digest == hashlib.sha256(raw(w["embed"]) + raw(w["proj"])).hexdigest()
    assert middle.stats()["chunks_sent"] > 0 and head.stats()["chunks_sent"] > 0
    assert middle.background_error() is None and head.background_error() is None
    events = middle.events()
    kinds = [e.kind for e in events]
    assert kinds[0] == laminar.RelayEvent.Kind.UPSTREAM and events[0].upstream == head_address
    committed = [e.version for e in events if e.kind == laminar.RelayEvent.Kind.COMMITTED]
    assert committed == [4]
    stored = [e.chunk for e in events if e.kind == laminar.RelayEvent.Kind.CHUNK_STORED and e.version == 4]
    assert sorted(stored) == list(range(len(stored))) and stored
    assert middle.events() == [] and middle.events_dropped == 0  # drained
