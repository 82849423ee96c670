"""Live role changes in the cluster simulator: a moving instance drains, loses nothing, then serves
its new role; a controller sees each window's traffic and moves instances to the split it wants."""

from pd_plugins.perf.cluster_sim import RoleChange, SimConfig, simulate
from pd_plugins.perf.hardware import preset
from pd_plugins.workloads import TraceRequest

HW = preset("llama-3.1-8b@h100")


def steady(n: int, gap_s: float, prompt: int = 2048, output: int = 64) -> list[TraceRequest]:
    return [TraceRequest(i, 0.001 + i * gap_s, prompt, output, tuple(range(i * 100, i * 100 + prompt // 512)))
            for i in range(n)]


def test_a_decode_moved_to_prefill_drains_first_loses_nothing_then_serves_prefill():
    reqs = steady(400, 0.05)  # 20 s of traffic; the move comes at 5 s, mid-stream
    result = simulate(reqs, SimConfig(HW, 1, 3, policy="round_robin",
                                      role_changes=(RoleChange(5.0, "http://sim-decode-2", "prefill"),)))
    assert [o.status for o in result.outcomes] == ["ok"] * 400
    (move,) = result.role_moves
    assert (move.from_role, move.to, move.asked_at_s) == ("decode", "prefill", 5.0)
    assert move.drained > 0 and move.done_at_s > 5.0  # it held requests and finished them first
    # it ran decodes until its drain ended (the last one's answer takes one more network hop),
    # and was given no new one once asked to move
    moved = "http://sim-decode-2"
    decoded_there = [o for o in result.outcomes if o.decode_url == moved]
    assert decoded_there and all(o.arrival_s < 5.0 for o in decoded_there)
    assert max(o.arrival_s + o.e2e_s for o in decoded_there) <= move.done_at_s + 0.001
    # after the drain, it takes prefills, and no prefill before
    prefilled_there = [o for o in result.outcomes if o.prefill_url == moved]
    assert prefilled_there and min(o.arrival_s for o in prefilled_there) >= move.done_at_s
    assert result.split_log == [(0.0, 1, 3), (move.done_at_s, 2, 2)]


def test_a_prefill_moved_to_decode_and_back_loses_nothing():
    reqs = steady(300, 0.05)
    moves = (RoleChange(3.0, "http://sim-prefill-1", "decode"),
             RoleChange(9.0, "http://sim-prefill-1", "prefill"))
    result = simulate(reqs, SimConfig(HW, 2, 2, policy="round_robin", role_changes=moves))
    assert [o.status for o in result.outcomes] == ["ok"] * 300
    assert [(m.to, m.done_at_s is not None) for m in result.role_moves] == [("decode", True),
                                                                         ("prefill", True)]
    back = result.role_moves[1].done_at_s
    assert [s[1:] for s in result.split_log] == [(2, 2), (1, 3), (2, 2)]
    # while it was a decode, it served decodes; once back, prefills again
    first_done, moved = result.role_moves[0].done_at_s, "http://sim-prefill-1"
    decoded_there = [o for o in result.outcomes if o.decode_url == moved]
    assert decoded_there and all(first_done <= o.arrival_s < 9.0 for o in decoded_there)
    assert any(o.prefill_url == moved and o.arrival_s > back for o in result.outcomes)


def test_the_last_instance_of_a_pool_is_not_moved_nor_one_already_in_the_role():
    reqs = steady(50, 0.05)
    moves = (RoleChange(1.0, "http://sim-prefill-0", "decode"),
             RoleChange(1.0, "http://sim-decode-0", "decode"))
    result = simulate(reqs, SimConfig(HW, 1, 2, policy="round_robin", role_changes=moves))
    assert result.role_moves == [] and [o.status for o in result.outcomes] == ["ok"] * 50


def test_a_controller_sees_each_windows_arrivals_and_gets_its_split():
    reqs = steady(400, 0.05)  # 20 s
    seen = []

    def controller(window):
        seen.append((window.start_s, window.end_s, len(window.arrivals), window.prefill, window.decode))
        return (3, 1) if window.end_s >= 10.0 else None

    result = simulate(reqs, SimConfig(HW, 1, 3, policy="round_robin", role_controller=controller,
                                      control_interval_s=5.0))
    assert seen[:2] == [(0.0, 5.0, 100, 1, 3), (5.0, 10.0, 100, 1, 3)]
    assert seen[2][3:] == (3, 1)  # the two moves asked at 10 s count at their destination
    assert [(m.to, m.asked_at_s) for m in result.role_moves] == [("prefill", 10.0)] * 2
    assert result.split_log[-1][1:] == (3, 1)
    assert [o.status for o in result.outcomes] == ["ok"] * 400


def test_a_controller_sees_the_requests_in_flight_with_their_first_token_once_it_came():
    reqs = steady(200, 0.05, output=400)  # 10 s; answers of 400 tokens outlast a 2 s window
    seen = []

    def controller(window):
        seen.append((window.end_s, [(o.request_id, o.arrival_s, o.ttft_s) for o in window.in_flight],
                     {o.request_id for o in window.ended}))
        return None

    result = simulate(reqs, SimConfig(HW, 1, 3, policy="round_robin", role_controller=controller,
                                      control_interval_s=2.0))
    ended_by = {o.request_id: o.arrival_s + o.e2e_s for o in result.outcomes}
    ended_so_far: set[int] = set()
    for end_s, in_flight, ended in seen[:5]:
        ended_so_far |= ended
        ids = {i for i, _, _ in in_flight}
        # exactly the arrivals not ended yet
        assert ids == {r.request_id for r in reqs if r.arrival_s < end_s} - ended_so_far
        assert all(ended_by[i] > end_s for i in ids)
        # a first token is known only once it came (its TTFT counts the hop back to the client)
        assert all(t is None or a + t <= end_s + 0.001 for _, a, t in in_flight)
    assert any(t is not None for _, _, t in seen[1][1]) and any(t is None for _, _, t in seen[1][1])
