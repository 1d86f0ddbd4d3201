"""laminar.KvMigrator between two workers in this process, each with its transport and its pools
(torch tensors, or pools the transport allocated and lends through DLPack): sequences move with
their pages, driven by poll(), and arrive with every K/V value and their state."""

import gc
import time

import numpy as np
import pytest
import torch

import laminar

TOKEN = b"laminar kv migrator python test"
LAYOUT = dict(num_pages=32, page_size=4, num_kv_heads=2, head_dim=64, dtype="f32", num_layers=2)
SHAPE = (2, 32, 4, 2, 64)


def transport():
    return laminar.Transport(laminar.TransportOptions(cluster_token=TOKEN))


class Worker:
    """allocated: the cache is KvMigrator.allocate_cache's, its pools read and written through
    torch.from_dlpack; otherwise the cache adopts torch pools of its own."""

    def __init__(self, version=3, allocated=False):
        self.transport = transport()
        self.address = self.transport.listen("127.0.0.1")
        self.layout = laminar.KvLayout(**LAYOUT)
        if allocated:
            self.allocated = laminar.KvMigrator.allocate_cache(self.transport, self.layout)
            self.cache = self.allocated.cache
            self.k, self.v = torch.from_dlpack(self.allocated.k_pool), torch.from_dlpack(self.allocated.v_pool)
        else:
            self.k, self.v = torch.zeros(SHAPE), torch.zeros(SHAPE)
            self.cache = laminar.PagedKvCache(self.layout, self.k, self.v)
        self.migrator = laminar.KvMigrator(self.transport, self.allocated if allocated else self.cache,
                                           laminar.KvMigratorOptions(lease=10, stall_timeout=10, connect_timeout=5))
        self.migrator.set_version(version)

    def tokens(self, sid):
        """[layers, length, heads, dim] K and V of a sequence, read through its token slots."""
        n = self.cache.length(sid)
        slots = [[self.cache.token_slot(sid, pos, layer) for pos in range(n)] for layer in range(2)]
        k = torch.stack([torch.stack([self.k[layer, p, o] for p, o in row]) for layer, row in enumerate(slots)])
        v = torch.stack([torch.stack([self.v[layer, p, o] for p, o in row]) for layer, row in enumerate(slots)])
        return k, v


def state_of(worker, sid):
    n = worker.cache.length(sid)
    return laminar.SequenceState(sequence=sid, trajectory=100 + sid, version=worker.migrator.version(), seed=7,
                                 rng_position=n, kv_length=n, prompt_tokens=list(range(n - 2)),
                                 response_tokens=[5, 6], logprobs=[-0.5, -0.25], engine_state=b"\x00engine")


def add_sequences(worker, lengths):
    for sid, n in lengths.items():
        worker.cache.add_sequence(sid)
        worker.cache.append_tokens(sid, n)


def migrate(source, destination, sent):
    """Moves the sequences of `sent` (id: state) by polling both sides; (migration id, every event,
    the ARRIVED event)."""
    mid = source.migrator.migrate(destination.address, sorted(sent))
    assert sorted(source.migrator.moving()) == sorted(sent)
    assert source.migrator.state(mid) == laminar.MigrationState.RUNNING
    seen = []
    arrived = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not ({"DONE", "ARRIVED"} <= {e.kind.name for e in seen}):
        for e in source.migrator.poll():
            seen.append(e)
            assert e.outgoing and e.id == mid and e.reason is None, e.reason
            if e.kind == laminar.MigrationEvent.Kind.PAUSE_REQUESTED:
                source.migrator.finish(e.id, [sent[s] for s in e.sequences])
        for e in destination.migrator.poll():
            seen.append(e)
            assert not e.outgoing
            if e.kind == laminar.MigrationEvent.Kind.ARRIVED:
                arrived = e
        time.sleep(0.001)
    return mid, seen, arrived


@pytest.mark.parametrize("allocated", [False, True], ids=["torch_pools", "allocated_pools"])
def test_sequences_move_with_their_pages(allocated):
    source, destination = Worker(allocated=allocated), Worker(allocated=allocated)
    lengths = {1: 9, 2: 5}
    add_sequences(source, lengths)
    for sid, n in lengths.items():
        for layer in range(2):
            for pos in range(n):
                page, offset = source.cache.token_slot(sid, pos, layer)
                source.k[layer, page, offset] = torch.randn(2, 64)
                source.v[layer, page, offset] = torch.randn(2, 64)
    before = {sid: source.tokens(sid) for sid in lengths}
    sent = {sid: state_of(source, sid) for sid in lengths}

    mid, seen, arrived = migrate(source, destination, sent)
    kinds = [e.kind.name for e in seen]
    assert "PAUSE_REQUESTED" in kinds and "DONE" in kinds and "ARRIVED" in kinds, kinds
    assert sorted(arrived.sequences) == [1, 2]
    for sid, state in zip(arrived.sequences, arrived.states):
        assert state == sent[sid]
        assert state.engine_state == b"\x00engine" and state.response_tokens.tolist() == [5, 6]
        k, v = destination.tokens(sid)
        assert torch.equal(k, before[sid][0]) and torch.equal(v, before[sid][1])
    for sid in lengths:
        with pytest.raises(laminar.NotFoundError):
            source.cache.length(sid)  # released from the source
    assert source.migrator.state(mid) == laminar.MigrationState.DONE
    assert source.migrator.moving() == []
    assert source.migrator.stats()["done_out"] == 1 and destination.migrator.stats()["done_in"] == 1
    assert source.migrator.background_error() is None


def test_allocated_pools_are_lent_to_numpy_and_torch_in_place():
    source, destination = Worker(allocated=True), Worker(allocated=True)
    pools = source.allocated
    assert pools.k_pool.shape == SHAPE and pools.k_pool.dtype == "f32" and pools.k_pool.__dlpack_device__() == (1, 0)
    assert pools.layout.num_pages == 32 and pools.cache is source.cache
    k, v = pools.k_pool.numpy(), pools.v_pool.numpy()
    assert k.shape == SHAPE and k.dtype == np.float32 and k.flags.c_contiguous and k.flags.writeable
    assert not k.any() and not v.any()  # zero-filled
    # The same memory whichever consumer imports it, and each import of it.
    imported = np.from_dlpack(pools.k_pool)
    assert imported.shape == SHAPE and imported.dtype == np.float32
    assert k.ctypes.data == source.k.data_ptr() == imported.ctypes.data == pools.k_pool.numpy().ctypes.data
    assert v.ctypes.data == source.v.data_ptr() != k.ctypes.data

    add_sequences(source, {4: 7})
    rng = np.random.default_rng(11)
    for layer in range(2):
        for pos in range(7):
            page, offset = source.cache.token_slot(4, pos, layer)
            k[layer, page, offset] = rng.standard_normal((2, 64), dtype=np.float32)
            v[layer, page, offset] = rng.standard_normal((2, 64), dtype=np.float32)
    before = source.tokens(4)
    assert before[0].abs().sum() > 0 and np.array_equal(imported, k)  # the other views see NumPy's writes

    mid, seen, arrived = migrate(source, destination, {4: state_of(source, 4)})
    assert arrived is not None, [e.kind.name for e in seen]
    # Read at the destination through NumPy: the bytes the migrator put there.
    dest_k, dest_v = destination.allocated.k_pool.numpy(), np.from_dlpack(destination.allocated.v_pool)
    for layer in range(2):
        for pos in range(7):
            page, offset = destination.cache.token_slot(4, pos, layer)
            assert np.array_equal(dest_k[layer, page, offset], before[0][layer, pos].numpy())
            assert np.array_equal(dest_v[layer, page, offset], before[1][layer, pos].numpy())
    assert destination.migrator.stats()["pages_received"] >= 2


def drop_and_reuse(layout):
    """After the caller dropped its cache: new zero-filled pools, which would take the memory back
    had what the caller still holds not kept it."""
    gc.collect()
    return [laminar.KvMigrator.allocate_cache(transport(), layout) for _ in range(2)]


@pytest.mark.parametrize("dtype,torch_dtype", [("f32", torch.float32), ("f16", torch.float16),
                                               ("bf16", torch.bfloat16)])
def test_lent_pools_outlive_their_cache(dtype, torch_dtype):
    layout = laminar.KvLayout(**dict(LAYOUT, dtype=dtype))
    t = transport()
    pools = laminar.KvMigrator.allocate_cache(t, layout)
    migrator = laminar.KvMigrator(t, pools)
    k, v = torch.from_dlpack(pools.k_pool), torch.from_dlpack(pools.v_pool)
    assert k.dtype == torch_dtype and tuple(k.shape) == SHAPE
    want_k, want_v = torch.randn(SHAPE).to(torch_dtype), torch.randn(SHAPE).to(torch_dtype)
    k.copy_(want_k)
    v.copy_(want_v)
    capsule = pools.v_pool.__dlpack__()  # never consumed: its deleter must still let go
    del pools, migrator, t, capsule
    others = drop_and_reuse(layout)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    k.zero_()  # still the tensors' own memory, and writable
    assert not k.any() and torch.equal(v, want_v)
    assert all(not torch.from_dlpack(o.k_pool).any() for o in others)

    pools = laminar.KvMigrator.allocate_cache(transport(), layout)
    if dtype == "bf16":
        with pytest.raises(laminar.InvalidArgumentError, match="bf16"):
            pools.k_pool.numpy()
        return
    k_np = pools.k_pool.numpy()
    k_np[...] = want_k.numpy()
    del pools
    drop_and_reuse(layout)
    assert np.array_equal(k_np, want_k.numpy())


def test_allocate_cache_refusals():
    t = transport()
    with pytest.raises(laminar.InvalidArgumentError, match="transport"):
        laminar.KvMigrator.allocate_cache(None, laminar.KvLayout(**LAYOUT))
    with pytest.raises(laminar.InvalidArgumentError, match="layout"):
        laminar.KvMigrator.allocate_cache(t, None)
    with pytest.raises(laminar.InvalidArgumentError, match="num_pages"):
        laminar.KvMigrator.allocate_cache(t, laminar.KvLayout(**dict(LAYOUT, num_pages=0)))
    pools = laminar.KvMigrator.allocate_cache(t, laminar.KvLayout(**LAYOUT))

    with pytest.raises(laminar.InvalidArgumentError, match="k_pool.*stream"):
        pools.k_pool.__dlpack__(stream=1)
    with pytest.raises(BufferError, match="v_pool"):
        pools.v_pool.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="dl_device"):
        pools.k_pool.__dlpack__(dl_device=(2, 0))
    with pytest.raises(laminar.InvalidArgumentError, match="max_version"):
        pools.k_pool.__dlpack__(max_version="1.0")
    with pytest.raises(laminar.InvalidArgumentError, match="copy"):
        pools.k_pool.__dlpack__(copy=1)
    # What a DLPack 1.0 consumer passes; the answer is a 0.x capsule, which the standard allows.
    capsule = pools.k_pool.__dlpack__(stream=None, max_version=(1, 0), dl_device=(1, 0), copy=False)
    assert torch.utils.dlpack.from_dlpack(capsule).data_ptr() == torch.from_dlpack(pools.k_pool).data_ptr()

    with pytest.raises(laminar.InvalidArgumentError, match="another transport"):
        laminar.KvMigrator(transport(), pools)
    with pytest.raises(laminar.InvalidArgumentError, match="cache must be"):
        laminar.KvMigrator(t, pools.k_pool)
    with pytest.raises(laminar.InvalidArgumentError, match="transport"):
        laminar.KvMigrator(None, pools)


def test_refusals():
    source = Worker()
    source.cache.add_sequence(1)
    source.cache.append_tokens(1, 3)
    with pytest.raises(laminar.NotFoundError):
        source.migrator.migrate("127.0.0.1:1", [9])
    with pytest.raises(laminar.InvalidArgumentError):
        source.migrator.migrate("127.0.0.1:1", [])
    with pytest.raises(laminar.NotFoundError):
        source.migrator.finish(12345, [])
    with pytest.raises(laminar.InvalidArgumentError, match="cache"):
        laminar.KvMigrator(source.transport, None)
    with pytest.raises(laminar.InvalidArgumentError, match="migration id -1"):
        source.migrator.state(-1)
    with pytest.raises(laminar.InvalidArgumentError, match="logprobs"):
        laminar.SequenceState(logprobs=torch.zeros(2, dtype=torch.int32))


def snapshot(worker, wid):
    ids = worker.live
    return laminar.WorkerSnapshot(
        id=wid, version=worker.migrator.version(), pages_total=worker.layout.num_pages,
        pages_used=worker.cache.used_pages, slots_total=8, slots_used=len(ids), step_time=0.02,
        kv_stopped_growing=True,
        sequences=[laminar.SequenceSnapshot(id=s, tokens=worker.cache.length(s), pages=len(worker.cache.pages(s)))
                   for s in ids])


def test_a_coordinator_repacks_two_drivers():
    coordinator_transport = laminar.Transport(laminar.TransportOptions(cluster_token=TOKEN))
    coordinator_address = coordinator_transport.listen("127.0.0.1")
    coordinator = laminar.RepackCoordinator(
        coordinator_transport, laminar.RepackCoordinatorOptions(tokens_per_page=4, stale_after=5))
    with pytest.raises(laminar.InvalidArgumentError):
        laminar.RepackCoordinator(laminar.Transport(laminar.TransportOptions(cluster_token=TOKEN)))
    workers = [Worker(), Worker()]
    lengths = [{1: 6}, {2: 30, 3: 25}]  # worker 0 holds little: it empties into worker 1
    drivers = []
    for wid, (w, seqs) in enumerate(zip(workers, lengths)):
        w.live = sorted(seqs)
        for sid, n in seqs.items():
            w.cache.add_sequence(sid)
            w.cache.append_tokens(sid, n)
        drivers.append(laminar.RepackDriver(w.transport, w.migrator, laminar.RepackDriverOptions(
            worker=wid, coordinator=coordinator_address, min_report_interval=0.01, retry_interval=0.01)))
    assert coordinator.prompts_waiting() is None and coordinator.stats()["prompts_waiting"] is None
    with pytest.raises(laminar.InvalidArgumentError, match="prompts_waiting is -1"):
        coordinator.set_prompts_waiting(-1)
    with pytest.raises(laminar.InvalidArgumentError, match="does not fit int64"):
        coordinator.set_prompts_waiting(2**70)
    coordinator.set_prompts_waiting(100)  # more than the freed worker's 8 slots take: worth freeing
    assert coordinator.prompts_waiting() == 100
    coordinator.set_newest_version(4)  # both workers hold version 3: draining
    assert coordinator.newest_version() == 4
    with pytest.raises(laminar.InvalidArgumentError):
        coordinator.set_newest_version(2)
    with pytest.raises(laminar.InvalidArgumentError):
        drivers[0].step(snapshot(workers[1], 1))  # another worker's snapshot

    kinds = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not {"DONE", "ARRIVED"} <= kinds:
        for wid, (w, driver) in enumerate(zip(workers, drivers)):
            for e in driver.step(snapshot(w, wid)):
                kinds.add(e.kind.name)
                if e.kind == laminar.MigrationEvent.Kind.PAUSE_REQUESTED:
                    w.migrator.finish(e.id, [state_of(w, s) for s in e.sequences])
                elif e.kind == laminar.MigrationEvent.Kind.DONE:
                    w.live = [s for s in w.live if s not in e.sequences]
                elif e.kind == laminar.MigrationEvent.Kind.ARRIVED:
                    w.live = sorted(w.live + list(e.sequences))
        time.sleep(0.005)
    assert {"DONE", "ARRIVED"} <= kinds, (kinds, coordinator.stats(), [d.stats() for d in drivers])
    assert workers[0].live == [] and workers[1].live == [1, 2, 3]
    assert workers[1].cache.length(1) == 6
    stats = coordinator.stats()
    assert stats["moves"] >= 1 and stats["workers_freed"] >= 1 and coordinator.background_error() is None
    assert stats["prompts_waiting"] == 100
    assert drivers[0].stats()["migrations_started"] == 1
