"""A PD request served from the connections' callbacks (routers/exchange.py), in process: pd-router's
own Router and front server on loopback, with scripted prefill and decode servers (raw HTTP, so
that a test can delay, fail or break one leg)."""

from __future__ import annotations

import asyncio
import contextlib
import json

from pd_plugins.routers.cli import build_parser, config_from_args
from pd_plugins.routers.http_client import Upstream
from pd_plugins.routers.http_server import FrontServer
from pd_plugins.routers.server import Router
from pd_plugins.routers.upstream import Pools
from pd_plugins.testing.raw_client import sample

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [1, 2],
          "remote_host": "127.0.0.1", "remote_port": 5600}
ANSWER = b'{"choices": [{"text": " world"}]}'


def http_answer(body: bytes, status: int = 200) -> bytes:
    return (b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
            % (status, len(body), body))


class Scripted:
    """A worker that answers each request (keep-alive) with `answer(n, body)`'s bytes, n from 0,
    `delay_s` after reading it; it keeps every request's JSON body."""

    def __init__(self, answer, delay_s: float = 0.0) -> None:
        self.answer, self.bodies, self.delay_s = answer, [], delay_s
        self.arrived: list[float] = []  # when each body was read (loop time)

    async def start(self) -> str:
        async def serve(reader, writer):
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    body = json.loads(await reader.readexactly(length))
                    self.arrived.append(asyncio.get_running_loop().time())
                    n = len(self.bodies)
                    self.bodies.append(body)
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    writer.write(self.answer(n, body))
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


def prefill_answers(n, body):
    return http_answer(json.dumps({"choices": [], "kv_transfer_params": PARAMS}).encode())


@contextlib.asynccontextmanager
async def pd_router(decode_answer, *args, decode: Scripted | None = None, front_of=None,
                    prefill_answer=prefill_answers, prefill_args: tuple = (),
                    prefill: Scripted | None = None):
    """A Router (vLLM pull, or as `args` say) in front of a scripted prefill (`prefill_answer`'s,
    or `prefill` itself; `prefill_args` after its URL) and decode (`decode_answer`'s, or `decode`
    itself): (port, router, prefill, decode); `front_of`: a list given the front server."""
    prefill, decode = prefill or Scripted(prefill_answer), decode or Scripted(decode_answer)
    router = Router(config_from_args(build_parser().parse_args(
        ["--prefill", await prefill.start(), *prefill_args, "--decode", await decode.start(),
         "--policy", "round_robin", *args])))
    group = router._only_group()
    pools = Pools(1.0)
    await group.start(router.metrics, pools, {}, None)
    for worker in group.pool:
        worker.healthy = True
    front = FrontServer(router.answer, lambda: None, max_body=1 << 20)
    front.fallback.connections = []  # (no aiohttp side here)
    if front_of is not None:
        front_of.append(front)
    listener = await asyncio.get_running_loop().create_server(front, "127.0.0.1", 0)
    try:
        yield listener.sockets[0].getsockname()[1], router, prefill, decode
    finally:
        if isinstance(decode, HeldStream):
            decode.release.set()
        listener.close()
        await front.shutdown(1.0)
        await group.proxy.aclose()
        await pools.close()
        prefill.server.close()
        decode.server.close()


def request_bytes(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(data), data))


async def read_answer(reader) -> tuple[int, bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return int(head.split(b" ")[1]), head, await reader.readexactly(length)


def counted(router, name: str, **labels) -> float:
    """A sample of the router's /metrics (its exposition, read in process)."""
    return sample(router.metrics.exposition().decode(), name, **labels)


async def until(predicate, timeout_s: float = 2.0) -> None:
    """Poll `predicate` until it holds or `timeout_s` passes (what follows asserts the rest)."""
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)


async def served_with_no_task(port: int, requests: int = 6) -> None:
    """`requests` PD requests on one keep-alive connection, answered 200 (ANSWER) and
    disaggregated; all but the first (which opens the legs' connections: tasks) with no task.
    The callback path is the point: a request served with a task per request would count here."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = {"model": "m", "prompt": "hello there", "max_tokens": 4}
    writer.write(request_bytes(body))
    assert (await read_answer(reader))[0] == 200
    loop, tasks = asyncio.get_running_loop(), []
    loop.set_task_factory(lambda loop, coro, **kw: tasks.append(coro) or asyncio.Task(
        coro, loop=loop, **kw))
    for _ in range(requests - 1):
        writer.write(request_bytes(body))
        status, head, answer = await read_answer(reader)
        assert (status, answer) == (200, ANSWER)
        assert b"x-pd-route: route=disaggregated" in head
    loop.set_task_factory(None)
    assert tasks == []  # none: the router made no task for them
    writer.close()


def test_pd_requests_on_a_keep_alive_connection_start_no_task():
    async def main():
        async with pd_router(lambda n, body: http_answer(ANSWER)) as (port, router, prefill, decode):
            await served_with_no_task(port)
            assert prefill.bodies[-1]["max_tokens"] == 1 and prefill.bodies[-1]["stream"] is False
            assert decode.bodies[-1]["kv_transfer_params"] == PARAMS
            assert len(prefill.bodies) == len(decode.bodies) == 6
            assert counted(router, "pd_router_requests_total", decision="disaggregated",
                           outcome="ok") == 6
    asyncio.run(main())


def test_the_books_wait_for_the_decode_leg_and_the_answer(monkeypatch):
    """What the router learns from a prefill's answer is booked once the decode leg is out, and
    the request leaves the books once its answer is written: neither is in its latency."""
    from pd_plugins.routers import exchange, http_server
    events = []
    real_send_leg, real_send_whole = exchange.send_leg, http_server._FrontConnection.send_whole

    def send_leg(pools, worker, *args, **kwargs):
        events.append(f"{worker.role} leg sent")
        return real_send_leg(pools, worker, *args, **kwargs)

    def send_whole(self, *args):
        events.append("answer written")
        return real_send_whole(self, *args)

    monkeypatch.setattr(exchange, "send_leg", send_leg)
    monkeypatch.setattr(http_server._FrontConnection, "send_whole", send_whole)

    async def main():
        async with pd_router(lambda n, body: http_answer(ANSWER)) as (port, router, prefill, decode):
            proxy = router._only_group().proxy
            for name, event in (("prefill_booked", "prefill booked"), ("finish", "finished")):
                real = getattr(proxy, name)
                monkeypatch.setattr(proxy, name, lambda *a, real=real, event=event:
                                    events.append(event) or real(*a))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            assert (await read_answer(reader))[:3:2] == (200, ANSWER)
            assert events == ["prefill leg sent", "decode leg sent", "prefill booked",
                              "answer written", "finished"]
            assert counted(router, "pd_router_requests_total", decision="disaggregated",
                           outcome="ok") == 1
            await settled(router)
            writer.close()
    asyncio.run(main())


def test_a_client_leaving_while_the_decode_connection_opens_releases_the_prefills_kv(monkeypatch):
    # The prefill has answered (it holds the prompt's KV for the decode to read); the decode
    # leg's connection is still being opened when the client leaves: no decode leg is sent for
    # the client, and a one-token leg reads (and so frees) the KV.
    async def main():
        async with pd_router(lambda n, body: http_answer(ANSWER)) as (port, router, prefill, decode):
            decode_port = int(router._only_group().pool.by_role("decode")[0].url.rsplit(":", 1)[1])
            opening = asyncio.Event()
            real_connect = Upstream._connect

            async def slow_connect(self):
                if self.port == decode_port:
                    opening.set()
                    await asyncio.sleep(0.3)
                return await real_connect(self)

            monkeypatch.setattr(Upstream, "_connect", slow_connect)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 9,
                                        "stream": True}))
            await asyncio.wait_for(opening.wait(), 5)
            writer.close()
            await until(lambda: decode.bodies)
            [release] = decode.bodies
            assert release["max_tokens"] == 1 and release["stream"] is False
            assert release["kv_transfer_params"] == PARAMS and release["prompt"] == "hello"
            metrics = router.metrics.exposition().decode()
            assert sample(metrics, "pd_router_client_gone_total", stage="decode",
                          how="disconnect") == 1
            assert sample(metrics, "pd_router_worker_in_flight") == 0
    asyncio.run(main())


def test_a_failed_decode_leg_is_retried_with_a_fresh_prefill():
    # the first decode answer is a 500: the attempt fails over (in a task), the request is
    # prefilled again and answered
    async def main():
        answers = lambda n, body: http_answer(b'{"error": "x"}', 500) if n == 0 else http_answer(ANSWER)
        async with pd_router(answers) as (port, router, prefill, decode):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            status, head, answer = await read_answer(reader)
            assert (status, answer) == (200, ANSWER)
            assert b"retried=1" in head
            assert len(prefill.bodies) == len(decode.bodies) == 2
            writer.close()
    asyncio.run(main())


def test_a_bug_in_the_callbacks_is_a_500_and_the_router_serves_on(monkeypatch):
    async def main():
        async with pd_router(lambda n, body: http_answer(ANSWER)) as (port, router, prefill, decode):
            proxy = router._only_group().proxy
            real = proxy.flow.decode_body
            calls = []

            def buggy(*args):
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("a bug")
                return real(*args)

            monkeypatch.setattr(proxy.flow, "decode_body", buggy)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            status, head, answer = await read_answer(reader)
            assert status == 500 and b"Connection: close" in head
            assert await reader.read() == b""  # and the connection closed
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            assert (await read_answer(reader))[0] == 200
            assert counted(router, "pd_router_worker_in_flight") == 0
            writer.close()
    asyncio.run(main())


def test_a_bug_in_the_books_after_the_bytes_is_logged_and_the_request_served(monkeypatch, caplog):
    # the decode leg is out (or the answer written) when the books run: a bug there is the
    # router's to log, not the client's to see; the decode's charge still ends
    async def main():
        async with pd_router(lambda n, body: http_answer(ANSWER)) as (port, router, prefill, decode):
            proxy = router._only_group().proxy
            for name in ("prefill_booked", "finish"):
                monkeypatch.setattr(proxy, name, lambda *a: 1 / 0)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(2):  # and the connection serves on
                writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
                assert (await read_answer(reader))[:3:2] == (200, ANSWER)
            await settled(router)
            writer.close()
    asyncio.run(main())
    failed = [r.getMessage() for r in caplog.records if r.exc_info]
    assert failed == ["booking a prefill's answer failed the router",
                      "closing a request's books failed"] * 2


def test_a_streamed_answer_is_relayed_to_its_end_with_no_task():
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]
    stream = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n"
              + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")

    async def main():
        async with pd_router(lambda n, body: stream) as (port, router, prefill, decode):
            loop, tasks = asyncio.get_running_loop(), []
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = {"model": "m", "prompt": "hello", "max_tokens": 5, "stream": True}
            for i in range(3):
                if i == 1:  # the first opened the legs' connections
                    loop.set_task_factory(lambda loop, coro, **kw: tasks.append(coro)
                                          or asyncio.Task(coro, loop=loop, **kw))
                writer.write(request_bytes(body))
                head = await reader.readuntil(b"\r\n\r\n")
                assert b"text/event-stream" in head and b"chunked" in head.lower()
                got = b""
                while not got.endswith(b"0\r\n\r\n"):
                    got += await reader.read(65536)
                assert all(e in got for e in events)
            loop.set_task_factory(None)
            assert tasks == []
            assert decode.bodies[-1]["stream"] is True and prefill.bodies[-1]["stream"] is False
            assert counted(router, "pd_router_requests_total", decision="disaggregated",
                           outcome="ok") == 3
            writer.close()
    asyncio.run(main())


class HeldStream(Scripted):
    """A decode that sends its stream's head and first event, then holds the rest until
    `release` is set; `closed` is set when the router closes the leg's connection."""

    def __init__(self) -> None:
        super().__init__(None)
        self.release, self.closed = asyncio.Event(), asyncio.Event()

    async def start(self) -> str:
        async def serve(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            self.bodies.append(json.loads(await reader.readexactly(length)))
            event = b"data: {\"n\": 0}\n\n"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n" % (len(event), event))
            await asyncio.wait([asyncio.ensure_future(self.release.wait()),
                                asyncio.ensure_future(reader.read())],
                               return_when=asyncio.FIRST_COMPLETED)
            if await_closed(reader):
                self.closed.set()
            writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


def await_closed(reader) -> bool:
    return reader.at_eof()


async def streaming(port: int):
    """A streamed request on a new connection, read up to its first event: (reader, writer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 9, "stream": True}))
    got = b""
    while b"data:" not in got:
        got += await reader.read(65536)
    return reader, writer


def test_a_client_leaving_mid_stream_closes_the_decode_leg_and_is_counted():
    async def main():
        async with pd_router(None, decode=HeldStream()) as (port, router, prefill, decode):
            reader, writer = await streaming(port)
            writer.close()  # mid-stream
            await asyncio.wait_for(decode.closed.wait(), 5)  # the leg closed: the engine aborts
            metrics = router.metrics.exposition().decode()
            assert sample(metrics, "pd_router_client_gone_total", stage="answer",
                          how="disconnect") == 1
            assert sample(metrics, "pd_router_requests_total", outcome="client_gone") == 1
            assert sample(metrics, "pd_router_worker_in_flight") == 0
    asyncio.run(main())


def test_a_client_gone_before_a_handed_over_task_began_releases_what_the_exchange_held():
    # the race of a relay that must hand over to a task (the client's socket full) just as the
    # client's connection is lost: the task is cancelled before its first step, so none of its
    # own cleanup runs; the exchange's must (the decode leg closed, the charges ended, counted)
    async def main():
        fronts = []
        async with pd_router(None, decode=HeldStream(), front_of=fronts) as (port, router, prefill,
                                                                              decode):
            reader, writer = await streaming(port)
            [conn] = fronts[0].connections
            exchange = conn.callbacks
            exchange.relay.held = True  # as if the client's socket had filled
            exchange._streamed()  # hands the relay over to a task ...
            assert conn.task is not None and conn.callbacks is None
            conn.connection_lost(None)  # ... which the client's leaving cancels before it began
            await asyncio.wait_for(decode.closed.wait(), 5)
            await asyncio.sleep(0)
            metrics = router.metrics.exposition().decode()
            assert sample(metrics, "pd_router_client_gone_total", stage="answer") == 1
            assert sample(metrics, "pd_router_worker_in_flight") == 0
            writer.close()
    asyncio.run(main())


def test_a_decode_refusing_the_request_is_passed_on_and_the_prefills_kv_released():
    async def main():
        answers = (lambda n, body: http_answer(b'{"error": "too long"}', 400) if n == 0
                   else http_answer(ANSWER))
        async with pd_router(answers) as (port, router, prefill, decode):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            status, head, answer = await read_answer(reader)
            assert (status, answer) == (400, b'{"error": "too long"}')
            # the one-token leg that reads (and frees) the prefill's KV
            await until(lambda: len(decode.bodies) == 2)
            release = decode.bodies[1]
            assert release["max_tokens"] == 1 and release["kv_transfer_params"] == PARAMS
            assert len(prefill.bodies) == 1  # no retry: another worker would refuse it too
            writer.close()
    asyncio.run(main())


# SGLang: both legs go out at once (the decode fetches the KV from the prefill's bootstrap
# server), from the connections' callbacks as vLLM's pull flow
SGLANG = ("--engine", "sglang")
BOOTSTRAP = ("8998",)  # the prefill's bootstrap port (nothing listens: the mocks are scripted)


async def settled(router, timeout_s: float = 2.0) -> None:
    """Until no leg is in the books (a prefill leg sent alongside may end after the answer)."""
    for _ in range(int(timeout_s / 0.02)):
        if all(w.in_flight == 0 and w.in_flight_tokens == 0 for w in router._only_group().pool):
            return
        await asyncio.sleep(0.02)
    raise AssertionError([(w.url, w.in_flight) for w in router._only_group().pool])


def test_sglang_requests_send_both_legs_at_once_and_start_no_task():
    async def main():
        async with pd_router(lambda n, body: http_answer(ANSWER), *SGLANG, prefill_args=BOOTSTRAP,
                             prefill_answer=lambda n, body: http_answer(b'{"choices": []}')
                             ) as (port, router, prefill, decode):
            await served_with_no_task(port)
            for sent_prefill, sent_decode in zip(prefill.bodies, decode.bodies):
                assert sent_prefill["bootstrap_room"] == sent_decode["bootstrap_room"]
                assert sent_prefill["bootstrap_port"] == sent_decode["bootstrap_port"] == 8998
                assert sent_prefill["stream"] is False and sent_decode["max_tokens"] == 4
            assert len({b["bootstrap_room"] for b in decode.bodies}) == 6
            await settled(router)
            assert counted(router, "pd_router_requests_total", decision="disaggregated",
                           outcome="ok") == 6
    asyncio.run(main())


def test_an_sglang_prefill_failing_before_the_decodes_answer_fails_the_attempt():
    # the prefill answers 500 while its decode holds its answer: the decode leg is closed (the
    # engine aborts it) and the attempt fails over; with the one prefill worker excluded, an
    # SGLang decode cannot prefill the prompt itself: 503, as the coroutine path answers it
    async def main():
        hold = lambda n, body: b""  # the decode never answers
        refuse = lambda n, body: http_answer(b'{"error": "x"}', 500)
        async with pd_router(hold, *SGLANG, prefill_args=BOOTSTRAP,
                             prefill_answer=refuse) as (port, router, prefill, decode):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            async with asyncio.timeout(5):
                status, head, answer = await read_answer(reader)
            assert status == 503 and b"no usable prefill worker" in answer
            assert len(prefill.bodies) == len(decode.bodies) == 1
            await settled(router)  # the decode leg's charges ended with it
            writer.close()
    asyncio.run(main())


def test_an_sglang_decode_failing_closes_a_prefill_still_running_and_keeps_the_books():
    # the first decode answers 500 while its prefill has not answered: the prefill leg is
    # closed and out of the books, the request tried again
    async def main():
        decode_answer = lambda n, body: (http_answer(b'{"error": "x"}', 500) if n == 0
                                         else http_answer(ANSWER))
        prefill_answer = lambda n, body: b"" if n == 0 else http_answer(b'{"choices": []}')
        async with pd_router(decode_answer, *SGLANG, prefill_args=BOOTSTRAP,
                             prefill_answer=prefill_answer) as (port, router, prefill, decode):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            async with asyncio.timeout(5):
                status, head, answer = await read_answer(reader)
            assert (status, answer) == (200, ANSWER) and b"retried=1" in head
            await settled(router)  # (the second prefill may answer after its decode)
            assert len(prefill.bodies) == len(decode.bodies) == 2
            writer.close()
    asyncio.run(main())


def test_an_sglang_client_leaving_closes_both_legs():
    async def main():
        hold = lambda n, body: b""  # neither leg ever answers
        async with pd_router(hold, *SGLANG, prefill_args=BOOTSTRAP,
                             prefill_answer=hold) as (port, router, prefill, decode):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            await until(lambda: prefill.bodies and decode.bodies)
            assert any(w.in_flight for w in router._only_group().pool)
            writer.close()
            await settled(router)
            assert counted(router, "pd_router_client_gone_total", stage="decode",
                           how="disconnect") == 1
    asyncio.run(main())


def test_an_sglang_prefill_ending_after_its_answer_only_keeps_the_books():
    # the decode answers first; the client's next request on the same connection is under way
    # when the first request's prefill answers (well, or with a 500): the answers stand, the
    # next request is not disturbed, and the books balance
    async def main():
        for prefill_status in (200, 500):
            late = Scripted(lambda n, body: http_answer(b'{"choices": []}', prefill_status), 0.2)
            async with pd_router(lambda n, body: http_answer(ANSWER), *SGLANG,
                                 prefill_args=BOOTSTRAP, prefill=late) as (port, router, _, decode):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                for _ in range(2):
                    writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
                    async with asyncio.timeout(2):
                        status, head, answer = await read_answer(reader)
                    assert (status, answer) == (200, ANSWER) and b"retried" not in head
                await settled(router)  # both prefills answered (0.2 s after their requests)
                assert len(late.bodies) == len(decode.bodies) == 2  # no attempt retried
                assert counted(router, "pd_router_requests_total", decision="disaggregated",
                               outcome="ok") == 2
                writer.close()
    asyncio.run(main())


PUSH = ("--transfer", "push")
PUSH_PREFILL = ("engine_id=p0", "kv_port=5600")  # (nothing listens: the mocks are scripted)


def test_push_requests_send_the_decode_leg_first_and_start_no_task():
    # vLLM push: the decode leg goes out first (it registers the blocks the prefill writes
    # into), the prefill leg push_head_start_s later on a timer (with none, right after it):
    # no task either way
    async def main():
        for head_start_s in (0.1, 0.0):
            decode = Scripted(lambda n, body: http_answer(ANSWER), 0.15)  # (waits for its KV)
            decodes_seen = []

            def prefill_answer(n, body):
                decodes_seen.append(len(decode.bodies))
                return http_answer(b'{"choices": [], "kv_transfer_params": null}')

            async with pd_router(None, *PUSH, prefill_args=PUSH_PREFILL, decode=decode,
                                 prefill_answer=prefill_answer) as (port, router, prefill, _):
                router._only_group().proxy.flow.head_start_s = head_start_s
                await served_with_no_task(port, requests=4)
                assert decodes_seen == [1, 2, 3, 4]  # each decode leg before its prefill leg
                waited = [p - d for p, d in zip(prefill.arrived, decode.arrived)]
                if head_start_s:
                    assert all(0.09 < w < 0.14 for w in waited), waited
                else:
                    assert all(0 <= w < 0.05 for w in waited), waited
                for sent_prefill, sent_decode in zip(prefill.bodies, decode.bodies):
                    params = sent_decode["kv_transfer_params"]
                    assert params["do_remote_prefill"] is True
                    assert params["remote_engine_id"] == "p0" and params["remote_port"] == 5600
                    assert sent_decode["max_tokens"] == 4
                    assert sent_prefill["max_tokens"] == 1 and sent_prefill["stream"] is False
                    assert sent_prefill["kv_transfer_params"]["do_remote_decode"] is True
                await settled(router)
                assert counted(router, "pd_router_requests_total", decision="disaggregated",
                               outcome="ok") == 4
    asyncio.run(main())


def test_a_push_client_leaving_during_the_head_start_sends_no_prefill_leg():
    async def main():
        hold = lambda n, body: b""  # the decode waits for KV that never comes
        async with pd_router(hold, *PUSH, prefill_args=PUSH_PREFILL) as (port, router, prefill,
                                                                          decode):
            router._only_group().proxy.flow.head_start_s = 1.0  # (the client leaves well within)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            await until(lambda: decode.bodies)
            writer.close()
            await asyncio.sleep(1.2)
            assert len(decode.bodies) == 1 and prefill.bodies == []  # the prefill never went out
            await settled(router)
            assert counted(router, "pd_router_client_gone_total", stage="decode",
                           how="disconnect") == 1
    asyncio.run(main())


def test_a_push_decode_failing_during_the_head_start_sends_no_prefill_leg_for_it():
    # the first decode leg answers 500 before its prefill leg's head start is over: that prefill
    # leg is never sent; the request is tried again (a prefill leg for the second attempt only)
    async def main():
        decode_answer = lambda n, body: (http_answer(b'{"error": "x"}', 500) if n == 0
                                         else http_answer(ANSWER))
        prefill_answer = lambda n, body: http_answer(b'{"choices": []}')
        async with pd_router(decode_answer, *PUSH, prefill_args=PUSH_PREFILL,
                             prefill_answer=prefill_answer) as (port, router, prefill, decode):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes({"model": "m", "prompt": "hello", "max_tokens": 4}))
            async with asyncio.timeout(5):
                status, head, answer = await read_answer(reader)
            assert (status, answer) == (200, ANSWER) and b"retried=1" in head
            # the retry's prefill leg goes out after its head start
            await until(lambda: prefill.bodies)
            await asyncio.sleep(0.2)  # (and no other comes)
            await settled(router)
            assert len(decode.bodies) == 2 and len(prefill.bodies) == 1
            assert prefill.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True
            assert decode.bodies[1]["kv_transfer_params"]["remote_request_id"] != \
                decode.bodies[0]["kv_transfer_params"]["remote_request_id"]
            writer.close()
    asyncio.run(main())
