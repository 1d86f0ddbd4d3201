"""RolloutDispatcher and DispatchClient over real transports: the admission rules, a request that
waits for work, exactly-once completion, and the reissue of a closed worker's samples."""

import threading

import pytest

import laminar

TOKEN = b"laminar python dispatch token 01"


def transport():
    return laminar.Transport(laminar.TransportOptions(cluster_token=TOKEN))


@pytest.fixture
def actor():
    """A dispatcher on a listening transport: (dispatcher, address, transport)."""
    t = transport()
    address = t.listen("127.0.0.1")
    d = laminar.RolloutDispatcher(t, laminar.RolloutDispatcherOptions(group_size=2, seed=5, max_wait=5.0))
    return d, address, t


def client(address, worker):
    return laminar.DispatchClient(transport(), laminar.DispatchClientOptions(worker=worker, server=address))


def test_sync_hands_out_the_open_groups_once(actor):
    d, address, _ = actor
    d.publish(1)
    assert d.open(2) == 0
    c = client(address, 1)
    stale = c.request(0, 4)
    assert stale.kind == laminar.GrantKind.PULL_NEWER and stale.pull_version == 1
    g = c.request(1, 4)
    assert g.kind == laminar.GrantKind.WORK and g.newest == 1
    assert sorted(s.id for s in g.samples) == [0, 1, 2, 3]
    assert all(s.id == s.prompt_index * 2 + s.sample_index for s in g.samples)
    for s in g.samples:
        assert not d.completed(s.id).duplicate
    assert d.completed(g.samples[0].id).duplicate
    d.wait_done(2, timeout=0)
    stats = d.stats()
    assert stats["groups_done"] == 2 and stats["completed"] == 4 and stats["duplicates"] == 1
    with pytest.raises(laminar.NotFoundError, match="of no group made"):
        d.completed(40)
    with pytest.raises(laminar.DeadlineExceededError):
        d.wait_done(3, timeout=0.01)


def test_a_request_waits_until_work_comes(actor, eventually):
    d, address, _ = actor
    d.set_rule(laminar.AdmissionRule.stream(1, 2))
    d.publish(3)
    c = client(address, 1)
    first = c.request(3, 2)
    assert len(first.samples) == 2
    held = [s.id for s in first.samples]
    answer = {}
    waiting = threading.Thread(target=lambda: answer.update(g=client(address, 2).request(3, 2, wait=4.0)))
    waiting.start()
    try:
        assert eventually(lambda: d.stats()["waiting_requests"] == 1)
        assert "g" not in answer
        # A group done makes room for the next one: the waiting request gets it.
        for tid in held:
            d.completed(tid)
    finally:
        waiting.join(10)
    assert answer["g"].kind == laminar.GrantKind.WORK and len(answer["g"].samples) == 2
    assert d.stats()["waited"] == 1


def test_a_closed_worker_loses_nothing(actor):
    d, address, _ = actor
    d.open(1, version_min=0, version_max=0)
    a = client(address, 1)
    g = a.request(0, 2)
    a.close()
    # Asked before or after the close is seen, the request waits for the samples to come back.
    b = client(address, 2)
    again = b.request(0, 2, wait=4.0)
    assert again.kind == laminar.GrantKind.WORK
    assert sorted(s.id for s in again.samples) == sorted(s.id for s in g.samples)
    assert [s.seed for s in sorted(again.samples, key=lambda s: s.id)] == \
        [s.seed for s in sorted(g.samples, key=lambda s: s.id)]
    assert d.stats()["lost_workers"] == 1 and d.stats()["reissued"] == 2


def test_a_sample_given_back_goes_out_again_at_once(actor):
    d, address, _ = actor
    d.open(1, version_min=0, version_max=0)
    a = client(address, 1)
    g = a.request(0, 2)
    kept, back = g.samples[0].id, g.samples[1].id
    assert a.request(0, 0, held=[kept], returned=[back]).kind == laminar.GrantKind.NOTHING
    b = client(address, 2)
    again = b.request(0, 2)
    assert [s.id for s in again.samples] == [back]
    stats = d.stats()
    assert stats["returned"] == 1 and stats["reissued"] == 1


def test_bad_arguments_name_what_is_wrong(actor):
    d, address, t = actor
    with pytest.raises(laminar.AlreadyExistsError, match="another one serves"):
        laminar.RolloutDispatcher(t, laminar.RolloutDispatcherOptions(group_size=2))
    with pytest.raises(laminar.InvalidArgumentError, match="group_size 0"):
        laminar.RolloutDispatcher(transport(), laminar.RolloutDispatcherOptions())
    with pytest.raises(laminar.InvalidArgumentError, match="below one group"):
        d.set_rule(laminar.AdmissionRule.stream(1, 1))
    with pytest.raises(laminar.InvalidArgumentError, match="both version_min and version_max"):
        d.open(1, version_min=0)
    d.set_rule(laminar.AdmissionRule.interruptible(1, 4))
    with pytest.raises(laminar.FailedPreconditionError, match="under a stream rule"):
        d.open(1)
    with pytest.raises(laminar.InvalidArgumentError, match="older than the newest"):
        d.publish(2)
        d.publish(1)
    with pytest.raises(laminar.InvalidArgumentError, match="free_slots"):
        client(address, 1).request(0, -1)
    assert d.background_error() is None
    assert laminar.AdmissionRule.interruptible(1, 4).kind == laminar.AdmissionKind.INTERRUPTIBLE
