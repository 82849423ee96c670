"""Seeded multi-turn chat workload: sessions whose prompts grow turn by turn and share prefixes.

Public traces either lack sessions (Azure) or hide them (Mooncake), so session pinning and
cache-affinity routing are tested on this generator. Turn t's prompt is the shared system prompt,
then every earlier user and assistant segment of its session, then the new user segment.

Block ids (`block_tokens` each, HASH_BLOCK_SIZE by default) follow the prefix-cache view of that prompt:
  * a full block lying entirely inside the system prompt has an id shared by all sessions;
  * any other full block k of session n has one id, the same in every turn of that session;
  * a partial last block has the id that block gets once a later turn fills it, so
    `prompt_token_ids` of turn t is a token-for-token prefix of turn t+1's (a real client resends
    the same text); only full blocks are cacheable, so the partial id never counts as a hit.
Ids are 64-bit blake2b hashes of (seed, scope, block index) with the top bit set, so they never
collide with Mooncake's small remapped ints or Azure's counter ids (from 2**40).

Arrivals are OPEN-LOOP: in reality turn t+1 is sent only after turn t has been answered, but here
turn t+1 arrives at turn t's arrival + an estimated service time (`service_s_per_output_token`
times turn t's output tokens) + a think time, whatever the system under test actually does.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from pd_plugins.workloads.trace import HASH_BLOCK_SIZE, TraceRequest, blocks_for


@dataclass(slots=True, frozen=True)
class ConversationSpec:
    """Distributions of the generated workload. Lognormals are given by median and sigma (of the
    underlying normal) and clipped to their (min, max) range; token counts are rounded."""

    session_rate_per_s: float = 0.5  # session starts form a Poisson process with this rate
    mean_turns: float = 4.0  # turns per session ~ 1 + Geometric(p = 1/mean_turns) ...
    max_turns: int = 20  # ... clipped here (lowers the mean by < 0.02 at the defaults)
    user_tokens_median: float = 300.0  # new user tokens per turn ~ lognormal
    user_tokens_sigma: float = 1.0
    user_tokens_range: tuple[int, int] = (8, 4096)
    assistant_tokens_median: float = 250.0  # answer tokens per turn ~ lognormal
    assistant_tokens_sigma: float = 0.8
    assistant_tokens_range: tuple[int, int] = (1, 2048)
    shared_system_tokens: int = 1024  # system prompt opening every session (0 = none)
    think_time_median_s: float = 20.0  # gap after a turn's estimated end ~ lognormal
    think_time_sigma: float = 1.0
    service_s_per_output_token: float = 0.03  # open-loop estimate of a turn's service time
    # tokens per block id: the traces' 512 by default; an engine's own (vLLM's 16 on GPUs) makes
    # a simulated prefix cache reuse history as finely as the engine's does
    block_tokens: int = HASH_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.session_rate_per_s <= 0 or self.mean_turns < 1 or self.max_turns < 1:
            raise ValueError("need session_rate_per_s > 0, mean_turns >= 1, max_turns >= 1")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        for lo, hi in (self.user_tokens_range, self.assistant_tokens_range):
            if not 1 <= lo <= hi:
                raise ValueError(f"token range must satisfy 1 <= min <= max, got {(lo, hi)}")


def block_id(seed: int, scope: str, index: int) -> int:
    """Deterministic 64-bit id with the top bit set (disjoint from Mooncake and Azure ids)."""
    digest = hashlib.blake2b(f"{seed}/{scope}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") | (1 << 63)


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def _turns(rng: random.Random, spec: ConversationSpec) -> int:
    """1 + Geometric(p = 1/mean_turns) failures, clipped to max_turns."""
    turns, p_more = 1, 1 - 1 / spec.mean_turns
    while turns < spec.max_turns and rng.random() < p_more:
        turns += 1
    return turns


def generate_conversations(spec: ConversationSpec, n_sessions: int, seed: int
                           ) -> list[TraceRequest]:
    """All turns of `n_sessions` sessions ("s0", "s1", ...), sorted by arrival, ids 0.. in that
    order. The same (spec, n_sessions, seed) always gives the same list."""
    rng = random.Random(seed)
    block = spec.block_tokens
    system_blocks = spec.shared_system_tokens // block  # full blocks inside it
    system_ids = [block_id(seed, "system", k) for k in range(system_blocks)]
    rows = []  # (arrival_s, session, turn, input_tokens, output_tokens, block_hashes)
    start = 0.0
    for n in range(n_sessions):
        start += rng.expovariate(spec.session_rate_per_s)
        session, arrival, context = f"s{n}", start, spec.shared_system_tokens
        full_ids = list(system_ids)  # ids of the session's full blocks, grown as turns add text
        for turn in range(_turns(rng, spec)):
            user = _lognormal_int(rng, spec.user_tokens_median, spec.user_tokens_sigma,
                                  *spec.user_tokens_range)
            answer = _lognormal_int(rng, spec.assistant_tokens_median, spec.assistant_tokens_sigma,
                                    *spec.assistant_tokens_range)
            n_in = context + user
            n_full = n_in // block
            full_ids += [block_id(seed, session, k) for k in range(len(full_ids), n_full)]
            hashes = full_ids[:n_full]
            if blocks_for(n_in, block) > n_full:
                hashes.append(block_id(seed, session, n_full))
            rows.append((arrival, n, turn, n_in, answer, tuple(hashes)))
            context = n_in + answer  # the answer becomes part of the next turn's prompt
            arrival += answer * spec.service_s_per_output_token + rng.lognormvariate(
                math.log(spec.think_time_median_s), spec.think_time_sigma)
    rows.sort(key=lambda row: row[:3])
    return [TraceRequest(request_id=i, arrival_s=t, input_tokens=n_in, output_tokens=n_out,
                         block_hashes=hashes, session_id=f"s{n}", turn=turn, block_tokens=block)
            for i, (t, n, turn, n_in, n_out, hashes) in enumerate(rows)]
