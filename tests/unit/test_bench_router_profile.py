"""bench/router_profile.py: the profile's shares are of the router's busy samples."""

from __future__ import annotations

from bench.router_profile import EVENT_LOOP, SOCKET_IO, shares

LOOP = "main (pd_plugins/routers/cli.py:213);run (asyncio/runners.py:190)"
SERVER = LOOP + ";_FrontConnection._consume (pd_plugins/routers/http_server.py:355)"
LEG = LOOP + ";Upstream._sent (pd_plugins/routers/http_client.py:480)"


def test_idle_samples_are_left_out_and_socket_calls_counted_apart(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join([
        f"{LOOP};epoll_pwait (libc.so.6) 50",             # waiting for work: not counted
        "thread (threading.py:1);__futex_abstimed_wait_common (libc.so.6) 30",  # an idle pool thread
        f"{LEG};write (libc.so.6) 5",                     # the leg's send: a system call
        f"{LEG};llhttp__internal__run (llhttp.c) 2",       # parsing, under the leg's frame
        f"{SERVER} 8",
        f"{LOOP};uv__io_poll (uvloop) 5",                  # the loop's own C, no frame of ours
    ]) + "\n")
    got = shares(raw)
    assert got["samples"] == 100 and got["busy_share"] == 20.0
    assert got["parts"] == {"front server (HTTP in/out)": 40.0, SOCKET_IO: 25.0, EVENT_LOOP: 25.0,
                            "legs' HTTP client": 10.0}
    assert sum(share for _, share in got["top_self"]) == 100.0


def test_a_profile_of_waits_alone_says_the_router_was_never_busy(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(f"{LOOP};epoll_pwait (libc.so.6) 40\n")
    got = shares(raw)
    assert got["samples"] == 40 and got["busy_share"] == 0.0 and got["parts"] == {}
