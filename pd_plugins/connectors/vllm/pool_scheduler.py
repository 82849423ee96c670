"""The scheduler side that PdShmConnector and PdLMCacheConnector share: what a pool connector
decides in vLLM's scheduler process, whatever the pool.

Each step it answers vLLM's lookups (how many of a new request's leading prompt tokens the pool
can supply), turns the allocated blocks of a hit into a load for the workers, follows the requests
whose prompt it stores (`store: pd`, PD prefill legs only, or `store: all`) and, when a prefill leg
finishes, answers the decode's side of the handshake: the PD flags, the `pd` section and the
transport's own keys. A transport that checks what it loads keeps a `VerdictBook`
(kv_verdicts.py): any other request that loaded KV gets `pd.kv`, its verdict, in its answer.

A transport subclass says how to find a prompt in its pool (`find`), what one load and one store
look like (`load_op`, `store_op`), and what its answer carries besides the shared keys (`answer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from pd_plugins.connectors.transfer_params import asks_remote_decode
from pd_plugins.connectors.vllm.kv_verdicts import VerdictBook, verdict_key
from pd_plugins.vocab.engines import TransferMode
from pd_plugins.vocab.transfer_params import KvDigest, PdSection

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

HitT = TypeVar("HitT")  # what a transport remembers of a pool hit until its blocks are allocated


@dataclass
class Storing:
    """A request whose prompt goes into the pool as the engine computes it."""

    request: Request
    next_block: int = 0  # blocks before this one were handed to the workers already


class PoolSchedulerSide(Generic[HitT]):
    """Request tracking, the last-token rule, what to store and the prefill's answer.

    `connector` provides `options` (`lookup`, `store`), `stores` (its role writes into the
    pool), `engine_id`, `block_size` and `kv_cache_manager`.
    """

    MODE: TransferMode  # the `pd` section's mode

    def __init__(self, connector: Any) -> None:
        self.c = connector
        self._hits: dict[str, HitT] = {}
        self._loads: list[Any] = []
        self._storing: dict[str, Storing] = {}
        self._cached: dict[str, int] = {}  # req id -> prompt tokens not computed (local + pool)
        self.verdicts: VerdictBook | None = self.verdict_book()

    # -- what a transport provides ------------------------------------------------------------
    def poolable(self, request: Request) -> bool:
        """Whether the pool can key this request at all (neither looked up nor stored if not)."""
        return True

    def find(self, request: Request, num_computed_tokens: int) -> tuple[int, HitT]:
        """The leading prompt tokens the pool supplies (counted from the prompt's start), and
        what `load_op` needs of the hit."""
        raise NotImplementedError

    def prefill_stored(self, params: dict[str, Any]) -> int | None:
        """Prompt tokens a decode leg's prefill says it put into the pool (a client's value,
        unchecked: only for a warning); None if it does not say."""
        return None

    def load_op(self, request: Request, blocks: KVCacheBlocks, hit: HitT,
                num_external_tokens: int) -> Any:
        raise NotImplementedError

    def begin_store(self, request: Request) -> Storing:
        return Storing(request)

    def store_op(self, storing: Storing, done: int) -> Any | None:
        """What to store this step, once `done` prompt tokens are computed (None: nothing)."""
        raise NotImplementedError

    def metadata(self, loads: list[Any], stores: list[Any]) -> KVConnectorMetadata:
        raise NotImplementedError

    def answer(self, request: Request) -> dict[str, Any]:
        """The transport's own keys in a prefill leg's answer."""
        return {}

    def verdict_book(self) -> VerdictBook | None:
        """Where this transport's load verdicts are kept (None: it reports none)."""
        return None

    def load_checked(self, op: Any) -> bool:
        """Whether the workers check the bytes of this load."""
        return False

    def load_blocks(self, op: Any) -> int:
        """How many blocks this load brings from the pool (its verdict's `blocks`)."""
        return len(op.block_ids)

    def kv_digest(self, request: Request) -> KvDigest | None:
        """The digests a prefill leg states of its prompt's KV (`pd.kv_digest`; None: none)."""
        return None

    def experts(self, request: Request) -> dict | None:
        """The prompt's experts for the `pd` section (None: not captured)."""
        return None

    def forget(self, request_id: str) -> None:
        """Drop a finished request's transport state (after `answer`)."""

    # -- vLLM's scheduler calls ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        req_id = request.request_id
        self._cached[req_id] = num_computed_tokens
        poolable = self.poolable(request)
        if not self.c.options.lookup or not poolable:
            return 0, False
        found, hit = self.find(request, num_computed_tokens)
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            expected = self.prefill_stored(params)
            if expected is not None and found < expected:
                logger.warning("%s: request %s: the pool has %d of the %d prompt tokens the "
                               "prefill stored (evicted, another pool, or the backend is down); "
                               "computing the rest", type(self.c).__name__, req_id, found,
                               expected)
        # vLLM computes at least the last prompt token itself
        tokens = max(0, min(found, request.num_tokens - 1) - num_computed_tokens)
        if tokens:
            self._hits[req_id] = hit
            self._cached[req_id] = num_computed_tokens + tokens
        return tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        hit = self._hits.pop(req_id, None)
        if num_external_tokens > 0 and hit is not None:
            op = self.load_op(request, blocks, hit, num_external_tokens)
            self._loads.append(op)
            if self.verdicts is not None:
                self.verdicts.expect(req_id, self.load_blocks(op), self.load_checked(op))
        if (self.c.stores and req_id not in self._storing and self.poolable(request)
                and (self.c.options.store == "all"
                     or asks_remote_decode(request.kv_transfer_params))):
            self._storing[req_id] = self.begin_store(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        loads, self._loads = self._loads, []
        stores = []
        bs = self.c.block_size
        for req_id, storing in list(self._storing.items()):
            request = storing.request
            computed = request.num_computed_tokens  # not yet this step's tokens
            if computed >= request.num_prompt_tokens:  # computed, and every load of it held
                del self._storing[req_id]
                continue
            # Blocks vLLM computes again (a failed load: the workers did not store them, nor
            # any after them) are stored again as they are computed.
            storing.next_block = min(storing.next_block, computed // bs)
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if not scheduled:
                continue
            op = self.store_op(storing, min(computed + scheduled, request.num_prompt_tokens))
            if op is not None:
                stores.append(op)
        return self.metadata(loads, stores)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.verdicts is not None:
            self.verdicts.record(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """The prefill leg's answer; for any other request that loaded KV, its verdict (`pd.kv`)
        when the transport checks its loads; None otherwise."""
        req_id = request.request_id
        self._storing.pop(req_id, None)
        self._hits.pop(req_id, None)
        cached = self._cached.pop(req_id, 0)
        answers = self.c.stores and asks_remote_decode(request.kv_transfer_params)
        own = self.answer(request) if answers else None
        digest = self.kv_digest(request) if answers else None
        self.forget(req_id)
        verdict = (self.verdicts.verdict(req_id, request.status == RequestStatus.FINISHED_ERROR)
                   if self.verdicts is not None else None)
        if verdict is not None:
            self.c.count_on_scheduler(verdict_key(verdict.verdict))
        if own is None:
            # a prefill leg's answer goes to its decode as that request's params: no verdict
            # there (counted all the same)
            return verdict.into(None) if verdict is not None else None
        section = PdSection(prompt_tokens=request.num_prompt_tokens, cached_tokens=cached,
                            engine_id=self.c.engine_id, mode=self.MODE,
                            block_size=self.c.block_size, experts=self.experts(request),
                            kv_digest=digest)
        return section.into({
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.c.engine_id, "remote_request_id": req_id,
            **own,
        })
