"""The policy framework: what a request looks like to a policy, and the five kinds of piece.

Modelled on llm-d's scheduler: filters narrow the candidates, scorers return a score in [0, 1] per
candidate and are combined by configured weights, a picker chooses; a decider says whether to
disaggregate at all; an admission step may reject early. Every piece registers under a name with a
factory that takes its parameters, so a YAML file can compose them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Callable, Protocol, Sequence

import msgspec
from msgspec import Meta

from pd_plugins.routers.config import ConfigError

if TYPE_CHECKING:
    from pd_plugins.routers.policy.latency_model import LatencyModels
    from pd_plugins.routers.policy.prefix_index import PrefixIndex
    from pd_plugins.routers.workers import Worker, WorkerPool


@dataclass
class RequestInfo:
    """What policies may know about a request before it runs."""

    prompt_tokens: int              # exact when the prompt is token ids or a tokenizer is set
    block_keys: list[int]           # chained hashes of the prompt's full blocks (prefix_index.py)
    max_tokens: int | None = None
    stream: bool = False
    session_id: str | None = None
    exact_tokens: bool = True
    adapter: str | None = None      # the LoRA adapter the request names (its block keys salted)
    # The prompt as its block keys were computed (token ids, or the text when they are estimated
    # from characters) and the width of a block in its units: session detection checks that a
    # next turn extends an earlier prompt's partial last block too. None: not known (traces).
    prompt: Sequence[int] | str | None = None
    block_width: int = 0
    # Filled in by the session table (routers/sessions.py) when sessions are tracked:
    turn: int = 0                   # turns of this conversation served before this one
    pinned_decode: str | None = None  # the decode worker that holds the conversation's KV
    resident_tokens: int = 0        # prompt tokens of the last turn, cached there
    # MoE: the prompt's expert histogram ([layers, experts], expert_signature.py), known once
    # the prefill has answered; the decode is then chosen again with it (ELDR)
    expert_histogram: Any = None


@dataclass
class Choice:
    worker: Worker
    reason: str


@dataclass
class Rejection:
    status: int
    message: str
    retry_after_s: float | None = None


@dataclass
class PolicyContext:
    """Shared state the pieces read: the pool, the prefix index, the latency models."""

    pool: WorkerPool
    prefix_index: PrefixIndex
    latency: LatencyModels
    block_size: int


class Filter(Protocol):
    def filter(self, request: RequestInfo, workers: list[Worker]) -> list[Worker]: ...


class Scorer(Protocol):
    def score(self, request: RequestInfo, workers: list[Worker]) -> list[float]: ...


class Picker(Protocol):
    def pick(self, workers: list[Worker], scores: list[float]) -> Worker: ...


class Decider(Protocol):
    """True to disaggregate (remote prefill), False to prefill on the decode worker."""

    def disaggregate(self, request: RequestInfo, decode: Worker,
                     prefills: list[Worker]) -> tuple[bool, str]: ...


class Admission(Protocol):
    """Early rejection, judged once the scheduler has chosen the request's route (`decision`;
    None where no route is known) and before any leg is sent."""

    def admit(self, request: RequestInfo, decision: Decision | None = None) -> Rejection | None: ...


Factory = Callable[[dict[str, Any], PolicyContext], Any]
_REGISTRY: dict[str, dict[str, Factory]] = {
    "filter": {}, "scorer": {}, "picker": {}, "decider": {}, "admission": {},
}


def register(kind: str, name: str) -> Callable[[Factory], Factory]:
    def wrap(factory: Factory) -> Factory:
        _REGISTRY[kind][name] = factory
        return factory
    return wrap


def register_plain(kind: str, name: str, make: Callable[[PolicyContext], Any]) -> None:
    """A piece without parameters, built by make(ctx): any key in its `params` is refused."""
    def factory(params: dict[str, Any], ctx: PolicyContext) -> Any:
        parse_params(params, NoParams, f"{kind} {name}")
        return make(ctx)
    _REGISTRY[kind][name] = factory


def build(kind: str, name: str, params: dict[str, Any], ctx: PolicyContext) -> Any:
    factories = _REGISTRY[kind]
    if name not in factories:
        raise ConfigError(f"unknown {kind} {name!r}; known: {', '.join(sorted(factories))}")
    return factories[name](params, ctx)


def registered(kind: str) -> list[str]:
    return sorted(_REGISTRY[kind])


def parse_params(params: dict[str, Any], schema: type, owner: str) -> Any:
    """Validate a piece's parameters against its Struct; errors name the piece and the key."""
    try:
        return msgspec.convert(params, schema)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{owner} params: {exc}") from None


class Params(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base for each piece's parameter schema."""


# The kinds of number a piece's parameters are, with their bounds (as the config's, Meta): outside
# them parse_params refuses the value naming the piece and the key (`admission slo params:
# Expected `float` > 0.0 - at `$.ttft_slo_ms``). Any bound refuses NaN, which compares false with
# everything (a NaN threshold silently never or always applied); each float has an upper bound,
# which refuses inf.
Share = Annotated[float, Meta(ge=0, le=1)]              # a fraction: KV usage, a match rate
Factor = Annotated[float, Meta(ge=0, le=1e6)]           # a multiplier or weight
Tokens = Annotated[int, Meta(ge=0, le=10_000_000)]      # past any model's context length
Requests = Annotated[float, Meta(ge=0, le=1_000_000)]   # a queue length or a load
Count = Annotated[int, Meta(ge=0, le=1_000_000)]        # requests, as a whole number
Millis = Annotated[float, Meta(gt=0, le=3_600_000)]     # an SLO: at most an hour


class NoParams(Params):
    """The schema of a piece without parameters: any key in its `params` is refused."""


def uncached_tokens(ctx: PolicyContext, worker: Worker, request: RequestInfo) -> int:
    """Prompt tokens `worker` must compute (at least one), by the router's prefix index."""
    if not request.block_keys:  # no piece reads prefixes (no keys computed): nothing matches
        return max(1, request.prompt_tokens)
    cached = ctx.prefix_index.matched_blocks(worker.url, request.block_keys) * ctx.block_size
    return max(1, request.prompt_tokens - cached)


def normalise_lower_is_better(values: Sequence[float]) -> list[float]:
    """Map costs to scores in [0, 1]: the cheapest gets 1, the dearest 0, all equal all 1."""
    low, high = min(values), max(values)
    if high - low <= 1e-12:
        return [1.0] * len(values)
    return [(high - v) / (high - low) for v in values]


@dataclass
class Decision:
    """The scheduler's answer for one request (also what the x-pd-route header reports)."""

    decode: Worker
    prefill: Worker | None          # None: the decode worker prefills locally
    reasons: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """How the request is served, as metrics and the route header say it."""
        return "disaggregated" if self.prefill is not None else "local"
