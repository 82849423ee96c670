"""LivePlanner: it moves on a shifted mix (as far as each step gains), not on a stationary one,
counts the work in flight, does not reverse a move within its dwell unless the reversal gains
many times over, drives the simulator's role changes, and applies a move to pd-router through its
admin API (real router, pd-mock-engine workers: `processes` tier)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from pd_plugins.perf.cluster_sim import RequestOutcome, SimConfig, simulate
from pd_plugins.perf.hardware import preset
from pd_plugins.perf.report import Slo
from pd_plugins.planner.dynamo_rule import dynamo_split
from pd_plugins.planner.live import (Hysteresis, LivePlanner, RouterRoles, apply_once,
                                     left_to_do, read_traffic, window_from_record)
from pd_plugins.planner.split import Split
from pd_plugins.workloads import TraceRequest

HW = preset("qwen3-30b-a3b@h100")  # decode steps read many experts: decode-heavy traffic shows
SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def steady(n: int, gap_s: float, prompt: int, output: int, start: float = 0.0, first_id: int = 0
           ) -> list[TraceRequest]:
    return [TraceRequest(first_id + i, start + i * gap_s, prompt, output,
                         tuple(range((first_id + i) * 1000, (first_id + i) * 1000 + -(-prompt // 512))))
            for i in range(n)]


def planner(**kw) -> LivePlanner:
    return LivePlanner(SLO, SimConfig(HW), "round_robin", window_s=20, interval_s=10, **kw)


def test_a_decode_heavy_window_climbs_toward_decode_as_far_as_each_step_gains():
    chat = steady(600, 0.033, prompt=256, output=300)
    d = planner().decide(20.0, chat, Split(3, 1))
    assert d.want == Split(1, 3)  # two instances in one move: each step predicted the margin
    assert d.scores[Split(2, 2)] > 2 * d.scores[Split(3, 1)]
    assert d.scores[Split(1, 3)] > 1.05 * d.scores[Split(2, 2)]
    assert set(d.scores) == {Split(3, 1), Split(2, 2), Split(1, 3)}  # the climb, nothing more
    # max_step bounds a move
    one = planner(hysteresis=Hysteresis(max_step=1)).decide(20.0, chat, Split(3, 1))
    assert one.want == Split(2, 2)


def test_a_window_the_split_already_serves_with_room_to_spare_moves_nothing_and_simulates_it_alone():
    light = steady(100, 0.2, prompt=1000, output=50)
    d = planner().decide(20.0, light, Split(2, 2))
    assert not d.moves and list(d.scores) == [Split(2, 2)]


def test_a_move_is_not_reversed_within_the_dwell_while_the_split_serves_but_is_after_it():
    p = planner(hysteresis=Hysteresis(margin=0.05, min_dwell_s=60, reverse_margin=100))
    chat = steady(600, 0.033, 256, 300)
    code = steady(100, 0.2, 8000, 4)  # 1P:3D serves it, but not at 1.5x its rate
    assert p.decide(20.0, chat, Split(2, 2)).want == Split(1, 3)
    held = p.decide(30.0, code, Split(1, 3))
    assert not held.moves and "dwell" in held.reason
    assert held.scores[Split(2, 2)] > 1.05 * held.scores[Split(1, 3)]  # it would gain, but waits
    assert p.decide(90.0, code, Split(1, 3)).want.prefill > 1


def test_within_the_dwell_a_reversal_goes_ahead_when_it_predicts_reverse_margin_more():
    chat, code = steady(600, 0.033, 256, 300), steady(100, 0.2, 8000, 4)
    for reverse_margin, moves in ((1.0, False), (0.25, True)):
        p = planner(hysteresis=Hysteresis(margin=0.05, min_dwell_s=60,
                                          reverse_margin=reverse_margin))
        assert p.decide(20.0, chat, Split(2, 2)).want == Split(1, 3)
        d = p.decide(30.0, code, Split(1, 3))
        assert d.moves == moves, d.reason
        assert 1.25 < max(d.scores.values()) / d.scores[Split(1, 3)] < 2


def test_within_the_dwell_a_split_that_fails_the_window_is_corrected_at_once():
    """The dwell holds back flapping between splits that serve the window; a split that misses
    the window at its own rate is reversed whatever the gain."""
    p = planner(hysteresis=Hysteresis(margin=0.05, min_dwell_s=60, reverse_margin=100))
    chat, heavy = steady(600, 0.033, 256, 300), steady(200, 0.1, 8000, 4)
    assert p.decide(20.0, chat, Split(2, 2)).want == Split(1, 3)
    way_out = p.decide(30.0, heavy, Split(1, 3))
    assert way_out.want == Split(3, 1)
    assert way_out.scores[Split(3, 1)] > 2 * way_out.scores[Split(1, 3)]


def test_the_work_in_flight_counts_a_queue_of_answers_moves_toward_decode():
    light = steady(300, 0.066, prompt=1000, output=50)   # 3P:1D serves this window alone ...
    alone = planner().decide(20.0, light, Split(3, 1))
    assert not alone.moves and list(alone.scores) == [Split(3, 1)]
    queue = steady(300, 0.0, prompt=256, output=300, first_id=10_000)  # ... not after this queue
    d = planner().decide(20.0, light, Split(3, 1), in_flight=queue)
    assert d.want == Split(1, 3) and d.scores[Split(1, 3)] > 1.05 * d.scores[Split(2, 2)]


def test_answers_in_progress_replay_their_prompts_ahead_of_the_window_not_in_its_way():
    """A prefilled request in flight holds its KV where it decodes; the simulator starts it at
    its prefill again, and that prefill must not delay the window as if it were new work. (The
    window simulated once: replayed over its answers' life at 1.5x its rate, 1P:3D would not
    serve it all, as a longer run of it shows; that is the next test's subject.)"""
    chat = steady(600, 0.033, 256, 300)
    answering = steady(100, 0.0, prompt=4000, output=100, first_id=10_000)
    ahead = planner(replay_life=False).decide(20.0, chat, Split(2, 2), decoding=answering)
    in_the_way = planner(replay_lead=False, replay_life=False).decide(20.0, chat, Split(2, 2),
                                                                      decoding=answering)
    assert ahead.want == Split(1, 3)
    assert ahead.scores[Split(1, 3)] == pytest.approx(len(chat) / 20, rel=0.05)  # all served
    assert ahead.scores[Split(1, 3)] > 2 * in_the_way.scores[Split(1, 3)]
    p = planner()
    assert p.lead_s(answering, Split(2, 2)) == pytest.approx(p.lead_s(answering, Split(1, 3)) / 2)
    assert p.lead_s([], Split(1, 3)) == 0.0


def test_a_window_shorter_than_its_answers_life_is_replayed_until_the_decode_pool_fills():
    """Answers of up to 50 s (1000 tokens at the TPOT SLO) holding 9k tokens of KV each: one 20 s
    window simulated once never fills two decodes, and 2P:2D looks as if it served the window
    with room to spare (at `headroom` = 1.5x its rate too); replayed back to back over an answer's
    life (3 times) it does not, and the planner moves to 1P:3D. A long run of the same traffic
    agrees: at its rate both splits serve it, at 1.5x it 2P:2D collapses and 1P:3D serves it.
    Short answers are simulated once, as before."""
    window = steady(20, 1.0, prompt=8000, output=1000)
    once = planner(replay_life=False)
    assert once.replays(window, 20.0) == 1
    assert not once.decide(20.0, window, Split(2, 2)).moves
    p = planner()
    assert p.replays(window, 20.0) == 3
    assert p.replays(window, 20.0 / 1.5) == 4  # at the headroom's pace: the same life, more replays
    assert p.decide(20.0, window, Split(2, 2)).want == Split(1, 3)
    faster = steady(450, 1 / 1.5, prompt=8000, output=1000)  # 300 s at 1.5x the window's rate
    served = {s: p.score(faster, s, 300.0)[0] / 1.5 for s in (Split(1, 3), Split(2, 2))}
    assert served[Split(1, 3)] > 0.9 and served[Split(2, 2)] < 0.5, served
    assert p.replays(steady(20, 1.0, prompt=8000, output=50), 20.0) == 1


def test_a_request_in_flight_has_left_what_its_answer_still_lacks():
    request = TraceRequest(7, 10.0, 1000, 200, (1, 2))
    waiting = RequestOutcome(7, 10.0, 1000, 200)
    assert left_to_do(request, waiting, 15.0, 0.02) == request        # no first token: all of it
    decoding = RequestOutcome(7, 10.0, 1000, 200, ttft_s=1.0)
    assert left_to_do(request, decoding, 15.0, 0.05).output_tokens == 200 - (1 + 80)
    assert left_to_do(request, decoding, 15.0, 0.05).input_tokens == 1000  # the KV it holds
    assert left_to_do(request, decoding, 60.0, 0.05).output_tokens == 1  # overdue: one step


def test_a_split_that_serves_the_window_without_room_to_spare_moves_when_headroom_is_asked():
    chat = steady(500, 0.04, prompt=256, output=300)   # 2P:2D serves it, at its limit
    alone = planner(headroom=1.0).decide(20.0, chat, Split(2, 2))
    assert not alone.moves and "serves" in alone.reason
    roomy = planner(headroom=1.5).decide(20.0, chat, Split(2, 2))
    assert roomy.want == Split(1, 3)
    assert roomy.scores[Split(1, 3)] > 1.05 * roomy.scores[Split(2, 2)]
    with pytest.raises(ValueError, match="headroom"):
        planner(headroom=0.5)


def test_dynamo_rules_split_is_a_candidate_and_preferred_among_about_equally_good_splits():
    code = steady(1000, 0.02, prompt=4000, output=20)

    def planner8(**kw) -> LivePlanner:
        return LivePlanner(SLO, SimConfig(HW), "round_robin", window_s=20, interval_s=10, **kw)

    rule = dynamo_split(code, profile=HW, itl_s=SLO.tpot_s, instances=8,
                        kv_capacity_tokens=HW.kv_capacity_tokens())
    assert rule == Split(6, 2)
    climbed = planner8(peer_candidate=False).decide(20.0, code, Split(1, 7))
    # the climb alone stops at the nearest split of the plateau, at its edge
    assert climbed.want == Split(5, 3)
    assert climbed.scores[Split(6, 2)] == pytest.approx(climbed.scores[Split(5, 3)], rel=0.05)
    with_rule = planner8().decide(20.0, code, Split(1, 7))
    assert with_rule.want == rule
    assert Split(3, 5) not in with_rule.scores  # straight there: fewer splits simulated


def test_the_margin_holds_back_a_small_predicted_gain():
    chat = steady(600, 0.033, 256, 300)
    gain = planner().decide(20.0, chat, Split(2, 2))
    ratio = gain.scores[gain.want] / gain.scores[Split(2, 2)]
    assert gain.moves and ratio > 1
    assert not planner(hysteresis=Hysteresis(margin=ratio)).decide(20.0, chat, Split(2, 2)).moves


def test_in_the_simulator_no_flapping_on_a_stationary_mix_and_moves_after_a_shift():
    # 60 s of a steady mix the 2P:2D start serves, then 60 s of chat that needs decode
    stationary = steady(300, 0.2, prompt=1000, output=50)
    shifted = stationary + steady(1800, 0.033, 256, 300, start=60.0, first_id=300)
    def run(requests):
        p = planner()
        config = SimConfig(HW, 2, 2, policy="round_robin", role_controller=p.sim_controller(),
                           control_interval_s=p.interval_s)
        return simulate(requests, config), p
    result, p = run(stationary)
    assert result.role_moves == [] and len(p.log) >= 5 and not any(d.moves for d in p.log)
    result, p = run(shifted)
    assert [(m.to, m.done_at_s is not None) for m in result.role_moves][:1] == [("decode", True)]
    assert all(m.asked_at_s > 60.0 for m in result.role_moves)
    tos = [m.to for m in result.role_moves]
    assert "prefill" not in tos  # no move back while the chat lasts
    assert [o.status for o in result.outcomes].count("failed") == 0


# -- against pd-router ---------------------------------------------------------------------------

def test_a_stale_or_missing_record_gives_an_empty_window(tmp_path):
    path = tmp_path / "traffic.jsonl"
    assert window_from_record(str(path), 60, None) == []
    line = {"t": 1000.0, "model": "m", "input_tokens": 10, "output_tokens": 2, "block_keys": [],
            "block_size": 16, "session": None, "turn": None, "decision": "disaggregated",
            "prefill": None, "decode": None, "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 0.2, "status": 200}
    path.write_text("".join(json.dumps({**line, "t": 1000.0 + i}) + "\n" for i in range(100)))
    os.utime(path, (1099.0, 1099.0))  # the last record was written at 1099 s
    window = window_from_record(str(path), 30, None, now=1099.0)
    # the last 30 s of arrivals, on the record's clock
    assert len(window) == 31 and window[0].arrival_s == 1069.0 and window[-1].arrival_s == 1099.0
    assert len(window_from_record(str(path), 30, None, now=1090.0)) == 31  # [1060, 1090]
    assert window_from_record(str(path), 30, None, now=1099.0 + 31) == []  # not written since


def test_the_window_adds_the_requests_in_flight_and_each_counts_the_work_it_has_left(tmp_path):
    """`read_traffic` over a record and a real TrafficRecorder's in-flight list (served to it
    by a stand-in for RouterRoles: tests/router/test_traffic_record.py has the real router)."""
    from pd_plugins.routers.config import TrafficRecordSpec
    from pd_plugins.routers.policy.base import RequestInfo
    from pd_plugins.routers.traffic_record import Measured, TrafficRecorder

    now = time.time()
    line = {"model": "m", "block_keys": [], "block_size": 16, "session": None, "turn": None,
            "decision": "disaggregated", "prefill": None, "decode": None, "ttft_s": 0.1,
            "tpot_s": 0.01, "e2e_s": 0.2, "status": 200}
    ended = [(now - 100, 40, 5), (now - 20, 64, 10), (now - 15, 48, 20), (now - 10, 32, 30)]
    path = tmp_path / "traffic.jsonl"
    path.write_text("".join(json.dumps({**line, "t": round(t, 6), "input_tokens": i,
                                        "output_tokens": o}) + "\n" for t, i, o in ended))
    recorder = TrafficRecorder(TrafficRecordSpec(path=str(tmp_path / "unused.jsonl")))

    def running(t: float, tokens: int, max_tokens: int | None, phase: str, streamed: int = 0):
        m = Measured(round(t, 6), phase=phase, streamed=streamed)
        recorder.started("m", RequestInfo(tokens, [7], max_tokens=max_tokens), 16, m)

    running(now - 15, 48, 99, "answer", 20)      # ended meanwhile: in the record too, counted once
    running(now - 8, 80, None, "queued")         # no max_tokens: the window's median answer
    running(now - 5, 96, 50, "answer", 12)       # prefilled, 12 tokens relayed: 38 left
    running(now - 60, 128, 40, "decode")         # before the window; prefilled: its answer left
    running(now - 3, 64, 30, "prefill")          # not prefilled yet: all of it

    class RouterStandIn:
        def in_flight(self):
            return recorder.in_flight(None, 5000, 100_000)

    traffic = read_traffic(RouterStandIn(), str(path), window_s=30)
    assert traffic.now_s >= now
    assert [(r.input_tokens, r.output_tokens) for r in traffic.window] == [
        (64, 10), (48, 20), (32, 30), (80, 20), (96, 50), (64, 30)]
    # not prefilled yet: all of their work; prefilled: as left_to_do in the simulator, the
    # prompt stays (the KV its answer holds) and the answer is what it still lacks
    assert [(r.input_tokens, r.output_tokens) for r in traffic.in_flight] == [(80, 20), (64, 30)]
    assert [(r.input_tokens, r.output_tokens) for r in traffic.decoding] == [(128, 40), (96, 38)]
    assert traffic.window[-2].block_hashes[0] == 7 and len(traffic.window[-2].block_hashes) == 6
    # every block neither list has a key for is its own: no two requests share one by accident
    requests = {r.request_id: r for r in (*traffic.window, *traffic.in_flight, *traffic.decoding)}
    assert len(requests) == 7
    own = [h for r in requests.values() for h in r.block_hashes if h != 7]
    assert len(own) == len(set(own)) == sum(len(r.block_hashes) for r in requests.values()) - 4


@pytest.mark.processes
def test_apply_once_moves_a_kv_both_worker_of_the_real_router():
    from pd_plugins.testing.router_harness import MockEngineProcess
    from tests.router.conftest import deployment

    @dataclasses.dataclass
    class KvBothMock(MockEngineProcess):
        def worker_arg(self) -> list[str]:
            return [self.url, "kv_both=true"]

    token = "live-token"
    prefills = [KvBothMock(f"p{i}", role="both") for i in range(2)]
    decode = MockEngineProcess("d0", role="decode")
    with deployment(prefills, [decode], "--policy", "round_robin",
                    env={"PD_ROUTER_ADMIN_TOKEN": token}) as router:
        roles = RouterRoles(router.url, token, drain_timeout_s=10)
        assert roles.split() == (Split(2, 1), False)
        chat = steady(600, 0.033, 256, 300)  # decode-heavy: the planner wants 1P:2D
        said = []
        d = apply_once(planner(), roles, chat, time.time(), say=said.append)
        assert d is not None and d.want == Split(1, 2)
        assert roles.split() == (Split(1, 2), False), said
        moved = {w["url"] for w in roles.workers() if w["role"] == "decode"} - {decode.url}
        assert len(moved) == 1 and moved <= {p.url for p in prefills}
        # a dry run decides (prompts of 8000 tokens want the prefill back) and moves nothing
        code = steady(400, 0.05, 8000, 4)
        d = apply_once(planner(), roles, code, time.time(), dry_run=True, say=said.append)
        assert d.want == Split(2, 1) and roles.split() == (Split(1, 2), False)
        with pytest.raises(Exception, match="401|403"):
            RouterRoles(router.url, "wrong").split()


class _AdminStub:
    """A real HTTP server on loopback that answers the planner as a broken router would:
    well-formed JSON of the wrong shape, or a redirect elsewhere. It records what it was sent."""

    def __init__(self, answers: dict[str, tuple[int, dict, bytes]]):
        import http.server
        import threading

        stub = self
        self.seen: list[tuple[str, str | None]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                stub.seen.append((self.path, self.headers.get("Authorization")))
                status, headers, body = answers.get(self.path.split("?")[0], (404, {}, b"{}"))
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_apply_survives_a_router_answering_the_wrong_shape(tmp_path, capsys):
    from pd_plugins.planner import cli

    record = tmp_path / "record.jsonl"
    record.write_text("")
    stub = _AdminStub({"/admin/in_flight": (200, {}, b"{}"),
                       "/admin/workers": (200, {}, b"[]")})
    try:
        code = cli.main(["--apply", stub.url, "--record", str(record), "--once",
                         "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50"])
    finally:
        stub.close()
    assert code == 1  # this interval failed, said so; no traceback
    assert "this interval failed: KeyError" in capsys.readouterr().out


def test_the_admin_token_never_follows_a_redirect():
    from pd_plugins.planner.live import AdminError

    elsewhere = _AdminStub({"/admin/workers": (200, {}, b'{"workers": []}')})
    router = _AdminStub({"/admin/workers": (302, {"Location": elsewhere.url + "/admin/workers"},
                                             b"")})
    try:
        with pytest.raises(AdminError, match="302"):
            RouterRoles(router.url, "secret-token").workers()
    finally:
        router.close()
        elsewhere.close()
    assert router.seen == [("/admin/workers", "Bearer secret-token")]
    assert elsewhere.seen == []  # the token went nowhere else
