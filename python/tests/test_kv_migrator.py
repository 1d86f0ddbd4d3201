"""laminar.KvMigrator between two workers in this process, each with its transport and torch pools:
sequences move with their pages, driven by poll(), and arrive with every K/V value and their state."""

import time

import pytest
import torch

import laminar

TOKEN = b"laminar kv migrator python test"
LAYOUT = dict(num_pages=32, page_size=4, num_kv_heads=2, head_dim=64, dtype="f32", num_layers=2)


class Worker:
    def __init__(self, version=3):
        self.transport = laminar.Transport(laminar.TransportOptions(cluster_token=TOKEN))
        self.address = self.transport.listen("127.0.0.1")
        self.layout = laminar.KvLayout(**LAYOUT)
        shape = (2, 32, 4, 2, 64)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.cache = laminar.PagedKvCache(self.layout, self.k, self.v)
        self.migrator = laminar.KvMigrator(self.transport, self.cache,
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


def test_sequences_move_with_their_pages():
    source, destination = Worker(), Worker()
    lengths = {1: 9, 2: 5}
    for sid, n in lengths.items():
        source.cache.add_sequence(sid)
        source.cache.append_tokens(sid, n)
        for layer in range(2):
            for pos in range(n):
                page, offset = source.cache.token_slot(sid, pos, layer)
                source.k[layer, page, offset] = torch.randn(2, 64)
                source.v[layer, page, offset] = torch.randn(2, 64)
    before = {sid: source.tokens(sid) for sid in lengths}
    sent = {sid: state_of(source, sid) for sid in lengths}

    mid = source.migrator.migrate(destination.address, [1, 2])
    assert sorted(source.migrator.moving()) == [1, 2]
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
        coordinator_transport, laminar.RepackCoordinatorOptions(tokens_per_page=4, interval=0.05, stale_after=5))
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
            worker=wid, coordinator=coordinator_address, report_interval=0.01, retry_interval=0.01)))
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
