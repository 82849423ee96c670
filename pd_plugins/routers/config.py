"""Router configuration: a YAML file for the full policy stack, flags for the common case.

Everything is a msgspec Struct with `forbid_unknown_fields`, so a typo fails at startup with an
error that names the bad key and where it is (`... at $.timeouts.prefil_s`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
import yaml
from msgspec import Meta

from pd_plugins.vocab.engines import Engine, TransferMode


class ConfigError(ValueError):
    """A configuration problem, worded for the person who wrote the file or the flags."""


class WorkerConflict(ConfigError):
    """A worker added while serving (admin API, discovery) is already another model's, or is
    moving into that role (a role change draining)."""


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# Bounds of the numbers below (Meta): msgspec refuses a value outside them while reading a config
# (YAML, flags, an admin API worker), naming its key: `Expected `float` > 0.0 - at
# `$.sessions.ttl_s``. Any bound also refuses NaN, and every float has an upper one, which
# refuses inf. (Older checks with their own messages are in RouterConfig.validate.)

# The prefix index's token block. Engines' KV blocks are 1 to a few hundred tokens; a prompt
# shorter than one block has no block key, so a larger size only turns prefix routing off
# (10**15 was accepted).
MAX_BLOCK_SIZE = 4096
BlockSize = Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
# An engine's tensor- or data-parallel ranks: SGLang picks the DP rank as room % dp_size (0
# divided by zero on every request); vLLM push hands tp_size to the decode.
Ranks = Annotated[int, Meta(ge=1, le=1024)]


class WorkerSpec(_Strict):
    url: str
    # vLLM push mode: the prefill's fixed NIXL engine id and side-channel port, which the decode
    # leg needs before the prefill has answered.
    engine_id: str | None = None
    kv_host: str | None = None
    kv_port: int | None = None
    tp_size: Ranks = 1
    # SGLang prefill: bootstrap server port and data-parallel size (rooms pick the DP rank).
    bootstrap_port: int | None = None
    dp_size: Ranks = 1
    # vLLM KV events (ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557) for the prefix_cache scorer.
    kv_events: str | None = None
    # `bind:` endpoints other than loopback or ipc accept events from any host that reaches them
    # (fake events skew routing): refused unless this is set (kv_sources/events.py).
    kv_events_bind_any: bool = False
    # The engine's KV-event replay socket (its --kv-events-config `replay_endpoint`, which it
    # binds), e.g. tcp://10.0.0.1:5558: batches the router missed are asked for again there.
    kv_events_replay: str | None = None
    # The shared KV pool this worker is on; its contents count as cached on the worker for the
    # prefix scorers. PdShmConnector: the pool's path (same host as the router; read directly).
    # PdLMCacheConnector: `lmcache:<any name shared by the pool's workers>` (learned from the
    # prefills' answers).
    kv_pool: str | None = None
    # The group a PdShmConnector pool is shared with (the engines' `pool_group`): the router then
    # reads a pool file of that group (mode 0660) made by another user; default: its own, 0600.
    kv_pool_group: str | int | None = None
    # The engine can serve either leg (vLLM kv_role kv_both): the router may move it between its
    # prefill and decode pools while serving (POST /admin/workers/role, a pd.role label change).
    kv_both: bool = False

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        try:
            port = parts.port  # raises on a port that is not a number within 0..65535
        except ValueError:
            port = 0
        if parts.scheme != "http" or not parts.hostname or port == 0:  # legs speak plain HTTP
            raise ValueError(f"worker url {self.url!r} must look like http://host:port")
        for name in ("kv_port", "bootstrap_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 65536:
                raise ValueError(f"worker {self.url}: {name} must be within 1 and 65535 "
                                 f"(got {value})")
        self.url = self.url.rstrip("/")
        if self.kv_events and self.kv_events.startswith("bind:"):
            from pd_plugins.routers.kv_sources.events import check_bind_endpoint  # loads ZMQ

            check_bind_endpoint(self.kv_events[5:], self.kv_events_bind_any)
        if self.kv_events_replay is not None:
            if not self.kv_events:
                raise ValueError(f"worker {self.url}: kv_events_replay needs kv_events")
            if (not self.kv_events_replay.startswith(("tcp://", "ipc://"))
                    or "*" in self.kv_events_replay):
                raise ValueError(f"worker {self.url}: kv_events_replay must be the tcp:// (host, "
                                 "not *) or ipc:// address of the socket the engine binds (got "
                                 f"{self.kv_events_replay!r})")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"


class ComponentSpec(_Strict):
    """One named policy piece and its parameters (validated by the piece's own factory)."""

    name: str
    # a scorer's share of the total; NaN made every total NaN
    weight: Annotated[float, Meta(ge=0, le=1e6)] = 1.0
    params: dict[str, Any] = {}


class ProfileSpec(_Strict):
    """How one pool (prefill or decode) is chosen: filters, weighted scorers, a picker."""

    filters: list[ComponentSpec] = []
    scorers: list[ComponentSpec] = []
    picker: ComponentSpec = msgspec.field(default_factory=lambda: ComponentSpec(name="max_score"))


class PolicySpec(_Strict):
    prefill: ProfileSpec = msgspec.field(default_factory=ProfileSpec)
    decode: ProfileSpec = msgspec.field(default_factory=ProfileSpec)
    # Whether to disaggregate this request at all: only if every decider agrees (none: always).
    deciders: list[ComponentSpec] = []
    # Early rejection (None: admit everything).
    admission: ComponentSpec | None = None


class TimeoutSpec(_Strict):
    connect_s: float = 3.0
    prefill_s: float = 60.0          # whole prefill leg
    decode_first_byte_s: float = 60.0  # streamed decode leg until its first byte
    decode_idle_s: float = 30.0      # longest silence between streamed chunks
    decode_total_s: float = 600.0    # whole decode leg (a non-streamed one has only this one)
    # one write to the client (a chunk, or a whole answer): a reader this slow is dropped
    client_write_s: float = 30.0


# Each retry is one more leg a failing request waits for (up to its timeout) before the client
# hears of it: 16 already tries more workers than a failing deployment has healthy ones.
Retries = Annotated[int, Meta(ge=0, le=16)]


class FailoverSpec(_Strict):
    prefill_retries: Retries = 1     # another prefill worker after a failed prefill leg
    decode_retries: Retries = 1      # another decode worker, only before the first byte
    local_prefill_fallback: bool = True  # no usable prefill worker: decode prefills itself


class KvVerifySpec(_Strict):
    """A decode whose KV mismatch counter rose by `failures` within `window_s` is out of rotation
    for `quarantine_s` (routers/kv_quarantine.py)."""

    failures: int = 3
    window_s: float = 60.0
    quarantine_s: float = 300.0


class HealthSpec(_Strict):
    interval_s: float = 5.0
    timeout_s: float = 10.0
    failure_threshold: int = 2       # consecutive failures (probes or live requests) to go down
    success_threshold: int = 1       # consecutive successful probes to come back
    canary: bool = True              # probe with a 1-token generation, not only GET /health
    metrics_interval_s: float = 1.0  # engine /metrics scrape (waiting queue, KV usage)
    # null: KV mismatches never take a decode out
    kv_verify: KvVerifySpec | None = msgspec.field(default_factory=KvVerifySpec)


class LatencySpec(_Strict):
    """Priors of the learned latency models (policy/latency_model.py) until samples arrive."""

    prefill_base_s: float = 0.02
    prefill_per_token_s: float = 0.0002
    decode_step_base_s: float = 0.02
    decode_step_per_request_s: float = 0.002
    kv_bytes_per_token: float = 0.0     # 0: KV transfer time not modelled
    link_bytes_per_s: float = 25e9

    def __post_init__(self) -> None:
        # every policy piece computes with these: one 0 link or NaN failed every request
        values = {f: getattr(self, f) for f in self.__struct_fields__}
        bad = [f"{f}={v!r}" for f, v in values.items() if not (math.isfinite(v) and v >= 0)]
        if bad or self.link_bytes_per_s <= 0:
            raise ValueError("latency priors must be finite and >= 0, link_bytes_per_s > 0: "
                             + (", ".join(bad) or f"link_bytes_per_s={self.link_bytes_per_s!r}"))


class SessionSpec(_Strict):
    """Conversation tracking (routers/sessions.py), on when a policy piece uses sessions."""

    # a conversation idle this long is forgotten (at most 30 days; Redis keeps the replicas'
    # stream as long, in ms: NaN or inf failed at startup)
    ttl_s: Annotated[float, Meta(gt=0, le=30 * 86400)] = 3600.0
    # past this, the least recently used are forgotten (memory: 4x as many prefix chains are kept)
    max_sessions: Annotated[int, Meta(ge=1, le=10_000_000)] = 100_000
    detect: bool = True              # find a session without an id from its prompt's prefix chain
    # Share session pins, in-flight loads, learned prefixes and latency samples between router
    # replicas through Redis (routers/replica_sync.py), e.g. redis://127.0.0.1:6379/0; None: alone.
    redis_url: str | None = None
    # Redis's password (AUTH), or PD_ROUTER_REDIS_PASSWORD: apart from redis_url, so that the URL
    # can sit in a ConfigMap and the password in a Secret (one of the two, not both)
    redis_password: str | None = None
    redis_prefix: str = "pd-router:session:"  # the stream's key is this + "replicas"
    # per Redis command (never on a request's path)
    redis_timeout_s: Annotated[float, Meta(gt=0, le=60)] = 0.25
    # local changes go out in batches this often
    sync_interval_s: Annotated[float, Meta(ge=0.005, le=10)] = 0.05
    # a replica not heard from this long counts no load (more than twice sync_interval_s)
    peer_load_ttl_s: Annotated[float, Meta(gt=0, le=3600)] = 2.0
    # batches Redis keeps (what a starting replica catches up on)
    redis_stream_len: Annotated[int, Meta(ge=10, le=1_000_000)] = 2000


MAX_MODEL_NAME = 256
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_LABEL_VALUE = 63
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def default_discovery_label(model: str) -> str:
    """The `pd.model` pod label value of a model: its name with every character a Kubernetes label
    value cannot hold replaced by '-' (Qwen/Qwen2.5-0.5B-Instruct -> Qwen-Qwen2.5-0.5B-Instruct)."""
    return _LABEL_UNSAFE.sub("-", model)


def is_label_value(value: str) -> bool:
    """A non-empty Kubernetes label value: at most 63 characters, [A-Za-z0-9] at both ends,
    [-A-Za-z0-9_.] between (a pod cannot carry any other, so no pod would ever match)."""
    return len(value) <= MAX_LABEL_VALUE and _LABEL_VALUE.fullmatch(value) is not None


class ModelSpec(_Strict):
    """One model behind the router: its own workers and, where set, its own policy (SLOs are the
    policy's admission piece), transfer mode, block size and tokenizer; None: the top level's."""

    name: str                        # the `model` requests name (and the route header shows)
    prefill: list[WorkerSpec] = []
    decode: list[WorkerSpec] = []
    policy: PolicySpec | None = None
    transfer: TransferMode | None = None
    block_size: BlockSize | None = None
    tokenizer: str | None = None
    # Kubernetes discovery: the pods' `pd.model` label value (None: default_discovery_label)
    discovery_label: str | None = None

    @property
    def pod_label(self) -> str:
        return self.discovery_label or default_discovery_label(self.name)

    def resolved(self, top: RouterConfig) -> ModelSpec:
        """This model with every unset option taken from the top level, except the tokenizer: one
        model's vocabulary would give another wrong block keys and prompt lengths (and wrong 400s
        for its context), so a model without its own counts text prompts' tokens by estimate."""
        return msgspec.structs.replace(
            self, policy=self.policy or top.policy, transfer=self.transfer or top.transfer,
            block_size=self.block_size or top.block_size)


class TrafficRecordSpec(_Strict):
    """What pd-router routes, one JSON line per request (routers/traffic_record.py): arrival,
    tokens, the prompt's prefix block keys, decision and latencies; never prompt text."""

    path: str                        # created 0600: it reveals traffic shape and block keys
    max_bytes: int = 64 * 1024 * 1024  # rotate past this size
    backups: int = 3                 # rotated files kept (path.1 .. path.N); 0: none
    max_block_keys: int = 256        # prefix block keys kept per request
    queue_size: int = 10_000         # records waiting for the writer; more are dropped (counted)


class DiscoverySpec(_Strict):
    """Workers found by an orchestrator while serving (routers/discovery/, docs/router.md)."""

    kind: Literal["kubernetes"] = "kubernetes"
    namespace: str | None = None     # None: the pod's own in a cluster, else the kubeconfig's
    selector: str = "app.kubernetes.io/part-of=pd-plugins"  # label selector of the engine pods
    kubeconfig: str | None = None    # None: in-cluster service account, else $KUBECONFIG
    # worker pods held at most; more wait for room (logged)
    max_pods: Annotated[int, Meta(ge=1, le=100_000)] = 1000
    # each watch's timeoutSeconds, then it resumes (the API server ends a watch itself after
    # --min-request-timeout, 30 to 60 minutes by default)
    watch_timeout_s: Annotated[int, Meta(ge=1, le=3600)] = 300
    # longest wait between retries while the API is unusable (NaN never capped the doubling)
    retry_max_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0


# logging's levels as --log-level spells them (setup_logging upper-cases them)
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class RouterConfig(_Strict):
    # what the router knows of each engine is in its profile (flows/<engine>.py)
    engine: Engine = "vllm"
    # gateway: choose both workers. sidecar: run beside one decode server, choose only the prefill.
    mode: Literal["gateway", "sidecar"] = "gateway"
    # vLLM: NIXL pull or push, or a pool (shm: PdShmConnector, lmcache: PdLMCacheConnector; both
    # run the pull flow's two steps)
    transfer: TransferMode = "pull"
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: list[WorkerSpec] = []
    decode: list[WorkerSpec] = []
    policy: PolicySpec = msgspec.field(default_factory=PolicySpec)
    timeouts: TimeoutSpec = msgspec.field(default_factory=TimeoutSpec)
    failover: FailoverSpec = msgspec.field(default_factory=FailoverSpec)
    health: HealthSpec = msgspec.field(default_factory=HealthSpec)
    latency: LatencySpec = msgspec.field(default_factory=LatencySpec)
    sessions: SessionSpec = msgspec.field(default_factory=SessionSpec)
    # Several models, each with its own workers (ModelSpec); empty: the top-level prefill and
    # decode serve whatever names they list in /v1/models.
    models: list[ModelSpec] = []
    # Optional tokenizer (a local path) so text prompts get exact token-block keys.
    tokenizer: str | None = None
    block_size: BlockSize = 16       # token block size of the prefix index (match the engines)
    # a request body past this is refused (413); 0 or less refused every request, and the router
    # holds a body in memory: at most 1 GiB
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 4 * 1024 * 1024
    # client connections open at once (inference and the rest together); one more is answered
    # 503 and closed. Keep it under the open-file limit (ulimit -n), which the legs' connections
    # to the workers share.
    max_connections: Annotated[int, Meta(ge=1, le=1_000_000)] = 10_000
    # What to do with client-sent transfer fields (kv_transfer_params, bootstrap_*, and those in
    # vllm_xargs; request.py): they never reach a worker.
    client_transfer_fields: Literal["reject", "strip"] = "reject"
    # vLLM push: decode leg goes this much before the prefill (every request's TTFT grows by it;
    # NaN or < 0 was accepted)
    push_head_start_s: Annotated[float, Meta(ge=0, le=10)] = 0.1
    admin_token: str | None = None   # bearer token for /admin; None: admin API disabled
    # x-pd-route response header: minimal (the decision and retries, nothing about the
    # deployment) or full (worker URLs, scores, session ids: for operators and tests).
    route_header: Literal["minimal", "full"] = "minimal"
    # TLS on the router's own listener (PEM files; legs to the workers stay plain HTTP).
    tls_cert: str | None = None
    tls_key: str | None = None
    # Client API keys (bearer tokens) for /v1/*: from here, a file (one per line) and
    # PD_ROUTER_API_KEYS (comma-separated); none at all: the API is open (client_auth.py).
    api_keys: list[str] = []
    api_key_file: str | None = None
    metrics_need_api_key: bool = False  # /metrics behind the same keys (/health, /ready stay open)
    log_level: LogLevel = "info"
    discovery: DiscoverySpec | None = None  # None: only the configured workers (and admin API)
    traffic_record: TrafficRecordSpec | None = None  # None: nothing recorded

    def workers_discovered(self) -> bool:
        """Whether workers arrive after startup (Kubernetes discovery), so that the router may
        start with no decode worker at all, or a model with none."""
        return getattr(self, "discovery", None) is not None

    def model_groups(self) -> list[ModelSpec]:
        """The models to serve, every option resolved: the `models:` entries, or without them one
        unnamed model ("") made of the top-level workers."""
        if self.models:
            return [model.resolved(self) for model in self.models]
        return [ModelSpec(name="", prefill=self.prefill, decode=self.decode, policy=self.policy,
                          transfer=self.transfer, block_size=self.block_size,
                          tokenizer=self.tokenizer)]

    def _validate_models(self) -> None:
        if self.prefill or self.decode:
            raise ConfigError("with `models:` every worker belongs to a model: move the top-level "
                              "prefill/decode workers into a model's entry (flags: put --prefill "
                              "and --decode after the --model they serve)")
        if self.mode == "sidecar":
            raise ConfigError("mode sidecar runs beside one decode server of one model: it "
                              "cannot serve `models:`")
        names: set[str] = set()
        owner: dict[str, str] = {}       # worker URL -> its model
        pool_owner: dict[str, str] = {}  # kv_pool -> its model
        label_owner: dict[str, str] = {}  # pod label -> its model
        for model in self.models:
            name = model.name
            if not (0 < len(name) <= MAX_MODEL_NAME and name.isascii() and name.isprintable()
                    and " " not in name and "," not in name):
                raise ConfigError(f"model name {name!r}: 1 to {MAX_MODEL_NAME} printable ASCII "
                                  "characters without spaces or commas")
            if name in names:
                raise ConfigError(f"model {name!r} is listed twice")
            names.add(name)
            if not model.decode and not self.workers_discovered():
                raise ConfigError(f"model {name!r} has no decode worker (give one, or configure "
                                  "discovery to find them)")
            if self.workers_discovered():  # the label only matters to discovery
                label = model.pod_label
                if not is_label_value(label):
                    raise ConfigError(
                        f"model {name!r}: its pod label {label!r} is no Kubernetes label value "
                        f"(1 to {MAX_LABEL_VALUE} characters, [A-Za-z0-9] at both ends, "
                        "[-A-Za-z0-9_.] between): set `discovery_label` for it")
                other = label_owner.setdefault(label, name)
                if other != name:
                    raise ConfigError(f"models {other!r} and {name!r} both have the pod label "
                                      f"{label!r}: set `discovery_label` for one of them")
            for role in ("prefill", "decode"):
                for worker in getattr(model, role):
                    other = owner.setdefault(worker.url, name)
                    if other != name:
                        raise ConfigError(f"worker {worker.url} is in models {other!r} and "
                                          f"{name!r}: an engine serves one model (adapters of it "
                                          "included), in either role")
                    pool = worker.kv_pool
                    other = pool_owner.setdefault(pool, name) if pool else name
                    if other != name:
                        raise ConfigError(
                            f"kv_pool {pool!r} is in models {other!r} and {name!r}: a pool holds "
                            "one model's KV (the router would count one model's blocks as "
                            "cached for the other): give each model its own pool")

    def validate(self) -> RouterConfig:
        if self.models:
            self._validate_models()
        elif not self.decode and not self.workers_discovered():
            raise ConfigError("no decode worker: give --decode URL (or `decode:` in the YAML)")
        if self.discovery is not None:
            if self.mode == "sidecar":
                raise ConfigError("mode sidecar runs beside one fixed decode server: no discovery")
        if self.mode == "sidecar" and len(self.decode) != 1:
            raise ConfigError("mode sidecar runs beside exactly one decode server "
                              f"(got {len(self.decode)} decode workers)")
        # what each engine needs of its workers is checked by its profile (flows/<engine>.py)
        # when the router is built
        # NaN compares false with everything: `value <= 0` let it through (a 500 per request, a
        # health loop that died silently)
        health = self.health
        for name, value in [*[(f"timeouts.{name}", value) for name, value
                              in msgspec.structs.asdict(self.timeouts).items()],
                            *[(f"health.{name}", getattr(health, name))
                              for name in ("interval_s", "timeout_s", "metrics_interval_s")]]:
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be finite and > 0 (got {value})")
        for name in ("failure_threshold", "success_threshold"):
            if getattr(health, name) < 1:
                raise ConfigError(f"health.{name} must be >= 1 (got {getattr(health, name)})")
        kv_verify = health.kv_verify
        if kv_verify is not None and not (kv_verify.failures >= 1 and kv_verify.window_s > 0
                                          and kv_verify.quarantine_s >= 0
                                          and math.isfinite(kv_verify.window_s)
                                          and math.isfinite(kv_verify.quarantine_s)):
            raise ConfigError("health.kv_verify: failures must be >= 1, window_s > 0, "
                              "quarantine_s >= 0, both finite")
        # failover, sessions, discovery and block sizes: their fields' bounds (Meta)
        if self.sessions.redis_url is not None:
            if not self.sessions.redis_url.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError("sessions.redis_url must be a redis://, rediss:// or unix:// URL "
                                  f"(got {self.sessions.redis_url!r})")
            password = self.sessions.redis_password
            if password is not None and (not password or urlsplit(self.sessions.redis_url).password):
                raise ConfigError("sessions.redis_password (PD_ROUTER_REDIS_PASSWORD) must not be "
                                  "empty, nor set beside a password in sessions.redis_url")
            if self.sessions.peer_load_ttl_s <= 2 * self.sessions.sync_interval_s:
                raise ConfigError("sessions.peer_load_ttl_s must exceed twice sync_interval_s")
        if not 0 <= self.port <= 65535:  # the OS took 70000 as 70000 - 65536
            raise ConfigError(f"port must be within 0 and 65535 (got {self.port})")
        record = self.traffic_record
        if record is not None and not (record.path and record.max_bytes >= 4096
                                       and 0 <= record.backups <= 100
                                       and 0 <= record.max_block_keys <= 100_000
                                       and 1 <= record.queue_size <= 1_000_000):
            raise ConfigError("traffic_record: path required, max_bytes >= 4096, backups 0..100, "
                              "max_block_keys 0..100000, queue_size 1..1000000")
        token = self.admin_token
        # None turns the admin API off; '' turned it on with a token no client can send (HTTP
        # strips `Bearer `'s trailing space), and a token with a space or newline at either end
        # (a secret file's) could never match either
        if token is not None and (not token or token != token.strip() or not token.isprintable()):
            raise ConfigError("admin_token (--admin-token, PD_ROUTER_ADMIN_TOKEN) must be "
                              "printable, without spaces at either end, and not empty "
                              f"(got {len(token)} characters); leave it unset to turn the admin "
                              "API off")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both tls_cert and tls_key (--tls-cert, --tls-key)")
        if self.metrics_need_api_key and not (self.api_keys or self.api_key_file):
            raise ConfigError("metrics_need_api_key is set but no API key is configured "
                              "(api_keys, --api-key-file or PD_ROUTER_API_KEYS)")
        return self


def config_from_mapping(data: dict[str, Any], source: str = "config") -> RouterConfig:
    models = data.get("models")
    if isinstance(models, list) and any(isinstance(model, str) for model in models):
        raise ConfigError(
            f"{source}: `models:` is no longer a list of served names: each entry is a model with "
            "its own workers, `models: [{name: ..., prefill: [...], decode: [...]}]`; to serve "
            "whatever names the top-level workers list, omit `models:`")
    try:
        config = msgspec.convert(data, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return config.validate()


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    return data


_BOOL_WORKER_OPTIONS = ("kv_events_bind_any", "kv_both")


def parse_worker_arg(values: list[str]) -> dict[str, Any]:
    """`URL [KEY=VALUE ...] [BOOTSTRAP_PORT]` from one --prefill/--decode flag."""
    url, *rest = values
    spec: dict[str, Any] = {"url": url}
    for item in rest:
        if item.isdigit():  # sglang-router style: --prefill URL 8998
            spec["bootstrap_port"] = int(item)
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"worker option {item!r} after {url}: expected KEY=VALUE")
        spec[key] = (int(value) if value.isdigit()
                     else value.lower() == "true" if key in _BOOL_WORKER_OPTIONS else value)
    return spec


def parse_model_arg(values: list[str]) -> dict[str, Any]:
    """`NAME [KEY=VALUE ...]` from one --model flag (policy=PRESET, transfer=, block_size=,
    tokenizer=, discovery_label=); the --prefill/--decode flags after it are its workers."""
    name, *rest = values
    spec: dict[str, Any] = {"name": name}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"model option {item!r} after --model {name}: expected KEY=VALUE")
        spec[key] = int(value) if value.isdigit() else value
    return spec
