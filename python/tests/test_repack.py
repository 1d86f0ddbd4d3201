"""laminar.plan_repack over fleets built in Python: the same plans the C++ tests expect."""

import pytest

import laminar


def worker(wid, version, sequences, pages_total=100, slots_total=8):
    """A draining worker holding (sequence id, pages) pairs, 16 tokens a page, as the C++ tests build."""
    return laminar.WorkerSnapshot(
        id=wid, version=version,
        sequences=[laminar.SequenceSnapshot(id=sid, tokens=pages * 16, pages=pages) for sid, pages in sequences],
        pages_total=pages_total, pages_used=sum(p for _, p in sequences), slots_total=slots_total,
        slots_used=len(sequences), step_time=0.02, kv_stopped_growing=True)


PAPER = laminar.RepackPolicyOptions(strategy=laminar.RepackStrategy.PAPER_BEST_FIT, growth_horizon_steps=0)


def test_paper_rule_picks_the_densest_destination():
    # Worker 1 holds 10 pages. Worker 2 (75 used) is left with 15 free after taking them, worker 3
    # (40 used) with 50: best fit picks worker 2.
    fleet = laminar.FleetSnapshot(tokens_per_page=16, workers=[worker(3, 1, [(30, 40)]), worker(1, 1, [(10, 10)]),
                                                               worker(2, 1, [(20, 75)])])
    plan = laminar.plan_repack(fleet, 2, PAPER)
    assert [(m.sequence, m.from_worker, m.to_worker, m.pages) for m in plan.moves] == [(10, 1, 2, 10)]
    assert [f.worker for f in plan.freed] == [1]
    assert plan.pages_moved == 10
    # The newest version's workers are left alone.
    assert laminar.plan_repack(fleet, 1, PAPER).moves == []


def test_the_readme_example():
    w = laminar.WorkerSnapshot(id=3, version=7, pages_total=32768, pages_used=313, slots_total=256, slots_used=1,
                               step_time=0.018, kv_stopped_growing=True,
                               sequences=[laminar.SequenceSnapshot(id=41, tokens=5000, pages=313,
                                                                   expected_remaining_tokens=1200)])
    busier = laminar.WorkerSnapshot(id=4, version=7, pages_total=32768, pages_used=1001, slots_total=256,
                                    slots_used=2, step_time=0.018, kv_stopped_growing=True,
                                    sequences=[laminar.SequenceSnapshot(id=42, tokens=9000, pages=563,
                                                                        expected_remaining_tokens=3000),
                                               laminar.SequenceSnapshot(id=43, tokens=7000, pages=438)])
    assert busier.sequences[1].expected_remaining_tokens is None
    plan = laminar.plan_repack(laminar.FleetSnapshot(tokens_per_page=16, workers=[w, busier]), 8)
    assert [(m.sequence, m.to_worker) for m in plan.moves] == [(41, 4)]
    assert [f.worker for f in plan.freed] == [3]
    freed = plan.freed[0]
    assert freed.gain > 0 and freed.busy_left > freed.move_time > 0
    assert plan.gain == pytest.approx(freed.gain) and plan.tail_growth >= 0


def test_bad_fleets_and_options_name_what_is_wrong():
    fleet = laminar.FleetSnapshot(tokens_per_page=16, workers=[worker(1, 1, [(10, 10)]), worker(2, 3, [(20, 5)])])
    with pytest.raises(laminar.InvalidArgumentError, match="worker 2: version 3 is newer"):
        laminar.plan_repack(fleet, 2)
    fleet.workers = [worker(1, 1, [(10, 10)]), worker(2, 1, [(10, 5)])]
    with pytest.raises(laminar.InvalidArgumentError, match="sequence 10 is listed twice"):
        laminar.plan_repack(fleet, 2)
    with pytest.raises(laminar.InvalidArgumentError, match="max_tail_growth"):
        laminar.plan_repack(fleet, 2, laminar.RepackPolicyOptions(max_tail_growth=-1.0))
    with pytest.raises(laminar.InvalidArgumentError, match="no field 'strategey'"):
        laminar.RepackPolicyOptions(strategey=laminar.RepackStrategy.COST_AWARE)
    with pytest.raises(laminar.InvalidArgumentError, match="worker id"):
        laminar.WorkerSnapshot(id=2**32)


def test_options_fields():
    o = laminar.RepackPolicyOptions(strategy=laminar.RepackStrategy.COST_AWARE, growth_horizon_steps=7,
                                    page_bytes=4096, link_bytes_per_s=1e9, move_overhead=0.002,
                                    step_seconds_per_token=None, max_tail_growth=0.1, min_gain=0.5,
                                    default_remaining_ratio=2.0)
    assert (o.growth_horizon_steps, o.page_bytes, o.link_bytes_per_s) == (7, 4096, 1e9)
    assert (o.move_overhead, o.step_seconds_per_token, o.max_tail_growth, o.min_gain) == (0.002, None, 0.1, 0.5)
    assert o.default_remaining_ratio == 2.0 and o.strategy == laminar.RepackStrategy.COST_AWARE
    w = laminar.WorkerSnapshot(waiting_prompts=3)
    assert w.waiting_prompts == 3 and w.sequences == [] and w.step_time == 0.0


def test_prompts_waiting_limits_the_workers_freed():
    # Workers 1 and 2 (2 pages free each) empty into worker 3; each freed worker has 8 slots.
    fleet = laminar.FleetSnapshot(tokens_per_page=16, workers=[
        worker(1, 1, [(10, 5)], pages_total=7), worker(2, 1, [(20, 6)], pages_total=8),
        worker(3, 1, [(30, 10)], pages_total=1000, slots_total=64)])
    options = laminar.RepackPolicyOptions(growth_horizon_steps=0, max_tail_growth=float("inf"))
    assert fleet.prompts_waiting is None
    assert [f.worker for f in laminar.plan_repack(fleet, 2, options).freed] == [1, 2]
    fleet.prompts_waiting = 0
    assert laminar.plan_repack(fleet, 2, options).freed == []
    fleet.prompts_waiting = 5
    assert [f.worker for f in laminar.plan_repack(fleet, 2, options).freed] == [1]
    options.only_for_waiting_prompts = False
    assert [f.worker for f in laminar.plan_repack(fleet, 2, options).freed] == [1, 2]
    with pytest.raises(laminar.InvalidArgumentError, match="max_step_slowdown"):
        laminar.plan_repack(fleet, 2, laminar.RepackPolicyOptions(max_step_slowdown=-1.0))
    fleet.prompts_waiting = -1
    with pytest.raises(laminar.InvalidArgumentError, match="prompts_waiting"):
        laminar.plan_repack(fleet, 2, options)
