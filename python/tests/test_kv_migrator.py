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
