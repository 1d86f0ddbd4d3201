"""laminar.Error and its subclasses: one per StatusCode, raised by real calls with their message."""

import pytest

import laminar

# Each class, its code, and the builtin it also subclasses (None: only laminar.Error).
CLASSES = [
    (laminar.InvalidArgumentError, laminar.StatusCode.INVALID_ARGUMENT, ValueError),
    (laminar.NotFoundError, laminar.StatusCode.NOT_FOUND, LookupError),
    (laminar.AlreadyExistsError, laminar.StatusCode.ALREADY_EXISTS, None),
    (laminar.FailedPreconditionError, laminar.StatusCode.FAILED_PRECONDITION, None),
    (laminar.OutOfRangeError, laminar.StatusCode.OUT_OF_RANGE, IndexError),
    (laminar.ResourceExhaustedError, laminar.StatusCode.RESOURCE_EXHAUSTED, None),
    (laminar.UnavailableError, laminar.StatusCode.UNAVAILABLE, None),
    (laminar.AbortedError, laminar.StatusCode.ABORTED, None),
    (laminar.DeadlineExceededError, laminar.StatusCode.DEADLINE_EXCEEDED, TimeoutError),
    (laminar.CancelledError, laminar.StatusCode.CANCELLED, None),
    (laminar.DataLossError, laminar.StatusCode.DATA_LOSS, None),
    (laminar.UnimplementedError, laminar.StatusCode.UNIMPLEMENTED, NotImplementedError),
    (laminar.InternalError, laminar.StatusCode.INTERNAL, None),
]


def test_one_class_per_code():
    codes = {code for _, code, _ in CLASSES}
    assert codes == set(laminar.StatusCode.__members__.values()) - {laminar.StatusCode.OK}
    for cls, _, builtin in CLASSES:
        assert issubclass(cls, laminar.Error)
        assert issubclass(cls, Exception)
        assert cls.__module__ == "laminar"
        if builtin is not None:
            assert issubclass(cls, builtin)
        assert cls.__doc__
    assert len({cls for cls, _, _ in CLASSES}) == len(CLASSES)


def raised(fn):
    with pytest.raises(laminar.Error) as info:
        fn()
    return info.value


def test_real_calls_raise_the_class_of_their_code(tmp_path, make_trajectory):
    q = laminar.TrajectoryQueue(laminar.TrajectoryQueueOptions(capacity_trajectories=1))
    q.push(make_trajectory(1))
    cases = [
        (lambda: laminar.TrajectoryQueue(laminar.TrajectoryQueueOptions(capacity_trajectories=0)),
         laminar.InvalidArgumentError, "capacity"),
        (lambda: q.ack(12345), laminar.NotFoundError, "12345"),
        (lambda: q.push(make_trajectory(1)), laminar.AlreadyExistsError, "1"),
        (lambda: laminar.TrajectoryQueue(laminar.TrajectoryQueueOptions(wal_path=str(tmp_path))),
         laminar.FailedPreconditionError, str(tmp_path)),
        (lambda: q.push(make_trajectory(2), block=False), laminar.UnavailableError, "full"),
        (lambda: q.push(make_trajectory(2), timeout=0.01), laminar.DeadlineExceededError, ""),
        (lambda: laminar.Trajectory.decode(make_trajectory(3).encode()[:-1]), laminar.DataLossError, ""),
    ]
    for fn, cls, fragment in cases:
        e = raised(fn)
        assert type(e) is cls, (fn, e)
        assert e.code == CLASSES[[c for c, _, _ in CLASSES].index(cls)][1]
        assert e.message == str(e)
        assert fragment in e.message
    q.close()
    e = raised(lambda: q.push(make_trajectory(4), block=False))
    assert type(e) is laminar.CancelledError


def test_builtin_bases_catch_them(make_trajectory):
    q = laminar.TrajectoryQueue()
    with pytest.raises(ValueError):
        q.publish_version(3)
        q.publish_version(2)
    with pytest.raises(LookupError):
        q.nack(99)
    with pytest.raises(TimeoutError):
        q.pop_batch(laminar.BatchSpec(max_trajectories=1, wait=0.01))
