"""vLLM's KV events into the prefix index: vLLM's own event structs, applied directly and over a
real ZMQ socket; malformed events and hostile bind addresses are refused."""

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from pd_plugins.routers.kv_sources.events import EventApplier, KvEventSubscriber
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.testing.processes import free_port
from pd_plugins.vocab.block_keys import block_keys

kv_events = pytest.importorskip("vllm.distributed.kv_events")
W = "http://w"


def stored(hashes, parent, tokens, size=4):
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                 block_size=size, lora_id=None, medium="GPU", lora_name=None)


def as_wire(event) -> dict:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(event))


def test_events_map_engine_hashes_onto_router_keys():
    index = PrefixIndex()
    events = EventApplier(index, W)
    tokens = list(range(12))
    events.apply(as_wire(stored([11, 12], None, tokens[:8])))
    events.apply(as_wire(stored([13], 12, tokens[8:12])))  # chained on engine hash 12
    keys = block_keys(tokens, 4)
    assert index.matched_blocks(W, keys) == 3
    events.apply(as_wire(kv_events.BlockRemoved(block_hashes=[12], medium="GPU")))
    assert index.matched_blocks(W, keys) == 1
    events.apply(as_wire(kv_events.AllBlocksCleared()))
    assert index.matched_blocks(W, keys) == 0
    assert not events.engine_keys


def test_a_salted_prompts_blocks_are_keyed_under_its_salt_and_images_are_not_indexed():
    """vLLM publishes each block's extra keys untagged: the LoRA name, (mm id, offset) pairs, the
    cache_salt on a prompt's first block. The salt roots the blocks' keys as it roots a salted
    request's (no credit across tenants); a block with an image is not indexed, nor any after."""
    from pd_plugins.vocab.block_keys import prompt_root

    tokens = list(range(12))

    def matched(extra_keys, lora=None, salt=None):
        index = PrefixIndex()
        event = kv_events.BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None,
                                      token_ids=tokens, block_size=4, lora_id=None, medium="GPU",
                                      lora_name=lora, extra_keys=extra_keys)
        EventApplier(index, W).apply(as_wire(event))
        return index.matched_blocks(W, block_keys(tokens, 4, prompt_root(lora, salt)))

    assert matched(None) == matched([None, None, None]) == 3
    assert matched([("my-lora",), ("my-lora",), ("my-lora",)], lora="my-lora") == 3
    salted = [("tenant-a",), None, None]
    assert matched(salted, salt="tenant-a") == 3  # the salted request finds its own blocks
    assert matched(salted) == 0 and matched(salted, salt="tenant-b") == 0  # no one else does
    assert matched([("my-lora", "tenant-a"), ("my-lora",), ("my-lora",)], lora="my-lora",
                   salt="tenant-a") == 3
    assert matched([None, (("mm-hash", 0),), None]) == 1  # an image from the second block on
    assert matched([("a", "b"), None, None]) == 0  # two strings: not a salt the router knows


def test_subscriber_reads_vllm_wire_format_over_zmq():
    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = PrefixIndex()
    tokens = list(range(40, 56))
    encoder = msgspec.msgpack.Encoder()

    async def scenario() -> int:
        sub = KvEventSubscriber(index, W, f"tcp://127.0.0.1:{port}")
        task = asyncio.create_task(sub.run())
        deadline = time.monotonic() + 10
        seq = 0
        while index.matched_blocks(W, block_keys(tokens, 4)) < 4 and time.monotonic() < deadline:
            batch = kv_events.KVEventBatch(ts=time.time(), events=[stored([1, 2, 3, 4], None, tokens)])
            pub.send_multipart((b"", seq.to_bytes(8, "big"), encoder.encode(batch)))
            seq += 1
            await asyncio.sleep(0.05)  # a SUB misses what is sent before it has connected
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sub.events_applied

    try:
        applied = asyncio.run(scenario())
    finally:
        pub.close(linger=0)
    assert applied >= 1
    assert index.matched_blocks(W, block_keys(tokens, 4)) == 4


def test_exact_mode_is_bounded_by_capacity_too():
    """An engine that stores and never removes (or lies) cannot grow the router past capacity."""
    index = PrefixIndex(capacity_blocks=50)
    events = EventApplier(index, W)
    tokens = list(range(4 * 1000))
    parent = None
    for i in range(1000):  # one block per event, chained as vLLM sends them
        events.apply(as_wire(stored([i + 1], parent, tokens[4 * i:4 * i + 4])))
        parent = i + 1
    assert index.held_blocks(W) == 50
    assert len(events.engine_keys) == 50
    # what was stored last is still known; a new prompt's first block is too
    fresh = list(range(9000, 9004))
    events.apply(as_wire(stored([5000], None, fresh)))
    assert index.matched_blocks(W, block_keys(fresh, 4)) == 1
    assert index.held_blocks(W) == 50


@pytest.mark.parametrize("event, words", [
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": "abcd",
      "block_size": 4}, "token_ids"),
    ({"type": "BlockStored", "block_hashes": [[1]], "parent_block_hash": None,
      "token_ids": [1, 2, 3, 4], "block_size": 4}, "block_hashes"),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
      "token_ids": [1, 2, 3, 4], "block_size": "4"}, "block_size"),
    ({"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
      "token_ids": [1, 2, 3, 4], "block_size": 4}, "token_ids"),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": [7],
      "token_ids": [1, 2, 3, 4], "block_size": 4}, "block_hashes"),
    ({"type": "BlockRemoved", "block_hashes": 3}, "block_hashes"),
    # a hash is kept per block: megabytes of one would hold the router's memory (200,000 blocks)
    ({"type": "BlockStored", "block_hashes": [b"h" * 65], "parent_block_hash": None,
      "token_ids": [1, 2, 3, 4], "block_size": 4}, "at most 64 bytes"),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": b"p" * (8 << 20),
      "token_ids": [1, 2, 3, 4], "block_size": 4}, "at most 64 bytes"),
    (17, "map"),
])
def test_malformed_events_are_refused_without_touching_the_index(event, words):
    from pd_plugins.routers.kv_sources.events import EventRejected

    index = PrefixIndex()
    events = EventApplier(index, W)
    events.apply(as_wire(stored([11], None, [5, 6, 7, 8])))
    with pytest.raises(EventRejected, match=words):
        events.apply(event)
    assert index.matched_blocks(W, block_keys([5, 6, 7, 8], 4)) == 1


def test_subscriber_survives_garbage_and_applies_the_next_good_batch():
    """A real PUB socket sends every kind of garbage, then a good batch: the subscriber task
    is still running, counted what it skipped, and the index holds the good batch."""
    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = PrefixIndex()
    tokens = list(range(60, 68))
    encoder = msgspec.msgpack.Encoder()
    bad_event = {"type": "BlockStored", "block_hashes": [[1]], "parent_block_hash": None,
                 "token_ids": [1, 2, 3, 4], "block_size": 4}
    garbage = [
        [b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"],
        [b"", (1).to_bytes(8, "big"), encoder.encode(5)],             # not a batch
        [b"", (2).to_bytes(8, "big"), encoder.encode([1.0, 5])],      # events not a list
        [b"", (3).to_bytes(8, "big"), encoder.encode([1.0, [bad_event, "x", None]])],
        [b"only one frame"],
    ]

    async def scenario(sub: KvEventSubscriber) -> bool:
        task = asyncio.create_task(sub.run())
        deadline = time.monotonic() + 10
        seq = 4
        while index.matched_blocks(W, block_keys(tokens, 4)) < 2 and time.monotonic() < deadline:
            for frames in garbage:
                pub.send_multipart(frames)
            good = kv_events.KVEventBatch(ts=time.time(), events=[stored([21, 22], None, tokens)])
            pub.send_multipart((b"", seq.to_bytes(8, "big"), encoder.encode(good)))
            seq += 1
            await asyncio.sleep(0.05)  # a SUB misses what is sent before it has connected
        alive = not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return alive

    sub = KvEventSubscriber(index, W, f"tcp://127.0.0.1:{port}")
    try:
        alive = asyncio.run(scenario(sub))
    finally:
        pub.close(linger=0)
    assert alive
    assert index.matched_blocks(W, block_keys(tokens, 4)) == 2
    assert sub.batches_rejected >= 4 and sub.events_rejected >= 3


@pytest.mark.parametrize("endpoint, allowed", [
    ("tcp://127.0.0.1:5557", True), ("tcp://localhost:5557", True), ("tcp://[::1]:5557", True),
    ("tcp://0.0.0.0:5557", False), ("tcp://*:5557", False), ("tcp://10.1.2.3:5557", False),
    ("ipc:///run/pd/events.sock", True), ("ipc://@events", False), ("udp://127.0.0.1:5557", False),
])
def test_bind_endpoints_other_than_loopback_need_an_explicit_opt_in(endpoint, allowed):
    from pd_plugins.routers.config import WorkerSpec
    from pd_plugins.routers.kv_sources.events import check_bind_endpoint

    spec = {"url": "http://10.0.0.1:8100", "kv_events": f"bind:{endpoint}"}
    if allowed:
        check_bind_endpoint(endpoint, allow_any_host=False)
        msgspec.convert(spec, WorkerSpec)
    else:
        with pytest.raises(ValueError, match="kv_events bind:"):
            check_bind_endpoint(endpoint, allow_any_host=False)
        with pytest.raises(msgspec.ValidationError, match="kv_events bind:"):
            msgspec.convert(spec, WorkerSpec)
    if endpoint.startswith("tcp://") and not allowed:
        msgspec.convert({**spec, "kv_events_bind_any": True}, WorkerSpec)  # the operator's call


def test_worker_flag_opts_in_with_true():
    from pd_plugins.routers.config import parse_worker_arg

    spec = parse_worker_arg(["http://h:1", "kv_events=bind:tcp://0.0.0.0:5557",
                             "kv_events_bind_any=true"])
    assert spec["kv_events_bind_any"] is True


def test_ipc_bind_makes_the_socket_private(tmp_path):
    import os
    import stat

    path = tmp_path / "events.sock"
    os.chmod(tmp_path, 0o755)

    async def scenario() -> int:
        sub = KvEventSubscriber(PrefixIndex(), W, f"bind:ipc://{path}")
        task = asyncio.create_task(sub.run())
        deadline = time.monotonic() + 5
        while not path.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        mode = stat.S_IMODE(os.stat(path).st_mode)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return mode

    assert asyncio.run(scenario()) & 0o077 == 0


def test_batch_number_gaps_are_counted_and_logged_at_most_once_a_while(caplog):
    # a publisher (bind: any local user) sending batches out of order must not flood the log
    import logging

    subscriber = KvEventSubscriber(PrefixIndex(), W, "tcp://127.0.0.1:1")
    empty = msgspec.msgpack.encode([0.0, []])
    with caplog.at_level(logging.WARNING):
        for i in range(1000):
            subscriber.handle([b"", (i % 2 * 7).to_bytes(8, "big"), empty])
    assert subscriber.sequence_gaps == 999
    assert len([r for r in caplog.records if "batches missed" in r.getMessage()]) == 1


EARLY_BATCHES = 2500  # more than vLLM's replay socket queues (1,000): some may be dropped


def test_missed_batches_are_replayed_from_vllms_own_publisher():
    """vLLM's ZmqEventPublisher with a replay socket (its `replay_endpoint`): a router that
    subscribes after the engine has published (or whose subscription was down) asks for the
    missed batches there and applies them in order, so a prompt the engine cached before the
    router listened is known. Without `replay`, the same subscriber knows only what it heard."""
    pub_port, replay_port = free_port(), free_port()
    publisher = kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{pub_port}",
                                            replay_endpoint=f"tcp://*:{replay_port}")
    early, late = list(range(16)), list(range(200, 216))

    def publish(hashes, tokens):
        publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=[stored(hashes, None, tokens)]))

    async def scenario(replay: str | None) -> tuple[PrefixIndex, KvEventSubscriber]:
        index = PrefixIndex()
        sub = KvEventSubscriber(index, W, f"tcp://127.0.0.1:{pub_port}", replay=replay)
        task = asyncio.create_task(sub.run())
        deadline = time.monotonic() + 30  # (a replay under way is not cut short)
        while index.matched_blocks(W, block_keys(late, 4)) < 4 and time.monotonic() < deadline:
            publish([21, 22, 23, 24], late)  # until the subscriber has connected and heard one
            await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return index, sub

    try:
        publish([1, 2, 3, 4], early)  # before any subscriber: no SUB hears it
        for i in range(EARLY_BATCHES):  # more than ZMQ queues by default (1,000): none lost
            publish([1000 + i], list(range(1000 + 4 * i, 1004 + 4 * i)))
        deadline = time.monotonic() + 10
        while publisher._event_queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.05)
        heard, plain = asyncio.run(scenario(None))
        replayed, sub = asyncio.run(scenario(f"tcp://127.0.0.1:{replay_port}"))
    finally:
        publisher.shutdown()
    assert heard.matched_blocks(W, block_keys(late, 4)) == 4
    assert heard.matched_blocks(W, block_keys(early, 4)) == 0  # missed: batch 0 was before it
    assert plain.batches_replayed == 0
    assert replayed.matched_blocks(W, block_keys(early, 4)) == 4  # batch 0, asked for again
    last = 1000 + 4 * (EARLY_BATCHES - 1)
    assert replayed.matched_blocks(W, block_keys(list(range(last, last + 4)), 4)) == 1
    assert sub.batches_replayed >= 1 + EARLY_BATCHES
    assert sub.sequence_gaps == 0  # every batch applied in order


END = (-1).to_bytes(8, "big", signed=True)  # vLLM's end of a replay


def scripted_replay(port: int, answers: list, asked: list) -> threading.Thread:
    """A ROUTER socket playing vLLM's replay socket (its wire format, as above), with batches
    5 to 44 in its buffer: answers[i] = (dropped, end): answer i sends the batches from the one
    asked for but those in `dropped`, then the end marker if `end`; a request past the last
    answer is counted, not answered."""
    encoder = msgspec.msgpack.Encoder()

    def engine():
        sock = zmq.Context.instance().socket(zmq.ROUTER)  # this thread's alone
        sock.setsockopt(zmq.RCVTIMEO, 3_000)
        sock.bind(f"tcp://127.0.0.1:{port}")
        try:
            for dropped, end in answers:
                client, _, start = sock.recv_multipart()
                asked.append(int.from_bytes(start, "big"))
                for seq in range(max(5, asked[-1]), 45):
                    if seq not in dropped:
                        batch = kv_events.KVEventBatch(ts=time.time(),
                                                       events=[stored([seq], None, [seq] * 4)])
                        sock.send_multipart([client, b"", b"", seq.to_bytes(8, "big"),
                                             encoder.encode(batch)])
                if end:
                    sock.send_multipart([client, b"", b"", END, b""])
            sock.setsockopt(zmq.RCVTIMEO, 500)  # (a retry comes at once)
            client, _, start = sock.recv_multipart()  # one more: counted, not answered
            asked.append(int.from_bytes(start, "big"))
        except zmq.Again:  # not asked again
            pass
        finally:
            sock.close(linger=0)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("answers, asked_for, replayed, gaps", [
    # a hole in the middle: asked for again from its first batch
    ([(range(20, 30), True), ((), True)], [0, 20], 35, 0),
    # the tail dropped with the end marker: the reply goes quiet, and the rest is asked for
    ([(range(38, 45), False), ((), True)], [0, 38], 35, 0),
    # a batch the engine no longer sends: a round brings nothing new, and the replay ends
    ([({25}, True), ({25}, True)], [0, 25], 34, 1),
], ids=["hole", "dropped-tail", "gone"])
def test_batches_a_replay_dropped_are_asked_for_again_from_the_first_missing(
        answers, asked_for, replayed, gaps):
    """vLLM's replay ROUTER drops what overflows its send queue when its I/O falls behind (a
    loaded host): the router asks again from the first batch missing after the first one that
    came (those before it are gone from the engine's buffer: not asked for), as long as each
    round brings batches it lacked, and within the replay's timeout."""
    port, asked = free_port(), []
    thread = scripted_replay(port, answers, asked)
    sub = KvEventSubscriber(PrefixIndex(), W, "tcp://127.0.0.1:1", replay=f"tcp://127.0.0.1:{port}")
    began = time.monotonic()
    asyncio.run(sub.replay_missed(until=40))  # the live batch 40 showed the gap
    took = time.monotonic() - began
    thread.join(timeout=10)
    assert asked == asked_for
    assert (sub.batches_replayed, sub.last_seq, sub.events_applied) == (replayed, 39, replayed)
    assert sub.sequence_gaps == gaps
    assert took < 1.5  # well within the replay's 2 s: nothing waited for its timeout


def test_an_engine_restart_forgets_what_the_worker_held_and_missed_batches_do_not():
    """A batch numbered below the last one's: the engine restarted (vLLM numbers from 0) with an
    empty cache, and nothing the index held for it is trusted. A batch numbered past the next:
    batches were missed, and the index keeps what it knew, since blocks that stay cached are
    never stored again: forgotten, a prompt extending a still-cached prefix would not chain."""
    index = PrefixIndex()
    subscriber = KvEventSubscriber(index, W, "tcp://127.0.0.1:1")
    encoder = msgspec.msgpack.Encoder()
    system, turn = list(range(16)), list(range(100, 108))

    def batch(seq: int, *events) -> None:
        payload = encoder.encode(kv_events.KVEventBatch(ts=time.time(), events=list(events)))
        subscriber.handle([b"", seq.to_bytes(8, "big"), payload])

    batch(0, stored([1, 2, 3, 4], None, system))
    batch(1)
    batch(5, stored([5, 6], 4, turn))  # batches 2-4 missed; chained on the cached prefix
    assert index.matched_blocks(W, block_keys(system + turn, 4)) == 6
    assert subscriber.sequence_gaps == 1
    batch(0)  # the engine restarted: its numbering starts over, its cache is empty
    assert index.matched_blocks(W, block_keys(system, 4)) == 0
    assert not subscriber.events.engine_keys
    assert subscriber.sequence_gaps == 2
    batch(1, stored([7, 8, 9, 10], None, system))  # learnt again as the engine stores it
    assert index.matched_blocks(W, block_keys(system, 4)) == 4


def test_a_batch_deeper_or_longer_than_any_engines_is_skipped_whole():
    # nesting: msgspec's RecursionError escaped handle(); millions of empty events were
    # decoded and rejected one by one, seconds of the event loop
    from pd_plugins.routers.kv_sources.events import MAX_BATCH_EVENTS

    subscriber = KvEventSubscriber(PrefixIndex(), W, "tcp://127.0.0.1:1")
    deep = msgspec.msgpack.encode(0.0)
    deep = b"\x92" + deep + b"\x91" * 100_000 + b"\x90"
    many = msgspec.msgpack.encode([0.0, [[]] * (MAX_BATCH_EVENTS + 1)])
    for n, payload in enumerate((deep, many)):
        subscriber.handle([b"", n.to_bytes(8, "big"), payload])
    assert (subscriber.batches_rejected, subscriber.events_rejected) == (2, 0)
    subscriber.handle([b"", (2).to_bytes(8, "big"), msgspec.msgpack.encode([0.0, [[]] * 3])])
    assert subscriber.events_rejected == 3  # up to the bound, each event on its own


def test_a_decode_steps_batch_of_many_pulled_prompts_is_applied():
    """A decode engine caches every pulled prompt whole in the step that admits it: 32 prompts of
    8k tokens in one batch (1.1 MiB; the 1 MiB bound of an earlier version skipped it whole)."""
    index = PrefixIndex()
    subscriber = KvEventSubscriber(index, W, "tcp://127.0.0.1:1")
    prompts = [[n * 100_000 + t for t in range(8192)] for n in range(1, 33)]
    events = [stored(list(range(n * 10_000, n * 10_000 + 8192 // 4)), None, tokens)
              for n, tokens in enumerate(prompts, 1)]
    payload = msgspec.msgpack.encode(kv_events.KVEventBatch(ts=0.0, events=events))
    assert len(payload) > 1 << 20
    subscriber.handle([b"", (0).to_bytes(8, "big"), payload])
    assert subscriber.batches_rejected == 0
    assert all(index.matched_blocks(W, block_keys(tokens, 4)) == 8192 // 4 for tokens in prompts)


def test_subscriber_drops_batches_over_its_bound_and_logs_bad_ones_once(caplog):
    """Over a real ZMQ socket: a batch over MAX_BATCH_BYTES (16 MiB before) is skipped undecoded,
    and the subscription goes on (ZMQ's own bound, MAXMSGSIZE, would end it for good); a deeply
    nested one is counted, not logged with its traceback each time."""
    import logging

    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = PrefixIndex()
    encoder = msgspec.msgpack.Encoder()
    big_tokens = [100_000 + n for n in range(1_800_000)]  # 5 bytes each: a step of 1.8M tokens
    big = encoder.encode(kv_events.KVEventBatch(ts=0.0, events=[
        stored(list(range(1, len(big_tokens) // 4 + 1)), None, big_tokens)]))
    assert 8 << 20 < len(big) < 16 << 20
    deep = b"\x92" + encoder.encode(0.0) + b"\x91" * 100_000 + b"\x90"
    seq = 0

    async def send_until_applied(tokens: list[int], first: tuple[bytes, ...] = ()) -> None:
        nonlocal seq
        deadline = time.monotonic() + 10
        while index.matched_blocks(W, block_keys(tokens, 4)) < 2 and time.monotonic() < deadline:
            good = kv_events.KVEventBatch(ts=time.time(), events=[stored([seq, -seq], None, tokens)])
            for payload in (*first, encoder.encode(good)):
                pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
                seq += 1
            first = ()
            await asyncio.sleep(0.05)  # a SUB misses what is sent before it has (re)connected

    async def scenario(sub: KvEventSubscriber) -> bool:
        task = asyncio.create_task(sub.run())
        await send_until_applied(list(range(70, 78)))  # connected
        await send_until_applied(list(range(80, 88)), first=(big, deep, deep, deep))
        alive = not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return alive

    sub = KvEventSubscriber(index, W, f"tcp://127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.WARNING, logger="pd_router.prefix_index"):
            alive = asyncio.run(scenario(sub))
    finally:
        pub.close(linger=0)
    assert alive and index.matched_blocks(W, block_keys(list(range(80, 88)), 4)) == 2
    assert index.matched_blocks(W, block_keys(big_tokens[:8], 4)) == 0
    assert len([r for r in caplog.records if r.name == "pd_router.prefix_index"
                and r.levelno >= logging.WARNING]) <= 1
