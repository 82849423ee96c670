"""What pd-plugins adds to a request's `kv_transfer_params`, typed on both ends.

- The leg flags the router (or a test client) sets on a prefill leg.
- The `pd` section a prefill engine adds to its answer: what the router needs to route well
  (cache hits, where the KV is, the prompt's experts). Written with `PdSection.into`, read with
  `pd_section_of`.
- `pd.kv` in a decode's (or any loading engine's) answer: whether the KV it loaded was verified
  (`KvVerdict`, read with `kv_verdict_of`; docs/plans/kv-verification.md §5). A prefill answer's
  `pd` section and a decode answer's `pd.kv` never share a parser.
- `lmcache_tokens`, beside it: how many prompt tokens a PdLMCacheConnector prefill put into the
  shared pool (the decode checks it; the router learns the pool's contents from it).

The engine's own transfer fields (engine id, host, port, block ids) are checked on the decode side
by pd_plugins/connectors/transfer_params.py.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from pd_plugins.vocab.engines import TransferMode

PD_SECTION_KEY = "pd"
STORED_TOKENS_KEY = "lmcache_tokens"

# A prefill leg: compute the prompt's KV and hold it for a remote decode (vLLM's NIXL names).
PREFILL_FLAGS = {"do_remote_decode": True, "do_remote_prefill": False}


def prefill_flags() -> dict[str, bool]:
    """A fresh copy of PREFILL_FLAGS (the engine may write into the dict it is given)."""
    return dict(PREFILL_FLAGS)


class KvDigest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A producer's digests of the prompt blocks it holds for a decode (issue 28)."""

    algo: str  # "ws64" (transfer/kv_digest.py)
    block_size: int  # tokens per block the digests were taken over
    ranks: list[str]  # per tensor-parallel rank: kv_digest.encode of its blocks, in order


class PdSection(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What the prefill engine tells the router about a finished prefill."""

    prompt_tokens: int  # tokens in the prompt the prefill served
    cached_tokens: int  # of those, how many came from the prefill's own prefix cache
    engine_id: str  # the prefill engine that holds the KV
    mode: TransferMode  # see vocab/engines.py
    block_size: int  # KV block size in tokens, for block-level cost models
    # pull: where the prefill answers lease checks (transfer/lease_check.py), on remote_host
    lease_check_port: int | None = None
    # MoE with expert_signatures on: the prompt's experts (vocab/expert_signature.py, encoded)
    experts: dict | None = None
    # NIXL pull with verify_kv: the prompt blocks' digests, for the decode to check its reads
    kv_digest: KvDigest | None = None

    def into(self, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
        """Add this section to a prefill answer's kv_transfer_params (and return them)."""
        kv_transfer_params[PD_SECTION_KEY] = msgspec.to_builtins(self)
        return kv_transfer_params


def pd_section_of(kv_transfer_params: dict[str, Any] | None) -> PdSection | None:
    """The `pd` section of a prefill answer's kv_transfer_params: None if absent, ValueError if
    it is there but malformed (it comes from a peer over the network)."""
    if not isinstance(kv_transfer_params, dict) or PD_SECTION_KEY not in kv_transfer_params:
        return None
    return _peer_struct(kv_transfer_params[PD_SECTION_KEY], PdSection, "pd section")


S = TypeVar("S", bound=msgspec.Struct)


def _peer_struct(value: Any, cls: type[S], what: str) -> S:
    """A peer's value as `cls`; ValueError naming `what` if it is not one."""
    try:
        return msgspec.convert(value, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed {what}: {exc}") from None


KV_VERDICT_KEY = "kv"  # inside the `pd` section of a loading engine's answer

# verified: every loaded block matched what its producer stated; recomputed: some did not (or
# could not be loaded) and the engine computed them itself; failed: the request ended in error
# (kv_load_failure_policy `fail`); unverified: loaded with nothing to check against
KvVerdictWord = Literal["verified", "recomputed", "failed", "unverified"]


class KvVerdict(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What a loading engine says about the KV it loaded for one request."""

    verdict: KvVerdictWord
    blocks: int      # blocks it loaded (or tried to) from the transport
    mismatched: int  # of those, blocks whose bytes did not match their producer's digest
    transport: TransferMode

    def into(self, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        """Add this verdict to an answer's kv_transfer_params (a new dict if None)."""
        params = dict(kv_transfer_params) if kv_transfer_params else {}
        section = params.get(PD_SECTION_KEY)
        params[PD_SECTION_KEY] = {**(section if isinstance(section, dict) else {}),
                                  KV_VERDICT_KEY: msgspec.to_builtins(self)}
        return params


def kv_verdict_of(kv_transfer_params: dict[str, Any] | None) -> KvVerdict | None:
    """`pd.kv` of an answer's kv_transfer_params: None if absent, ValueError if malformed."""
    section = (kv_transfer_params.get(PD_SECTION_KEY)
               if isinstance(kv_transfer_params, dict) else None)
    if not isinstance(section, dict) or KV_VERDICT_KEY not in section:
        return None
    return _peer_struct(section[KV_VERDICT_KEY], KvVerdict, "pd.kv verdict")


def stored_tokens_of(kv_transfer_params: dict[str, Any] | None) -> int | None:
    """`lmcache_tokens` of a prefill answer, or None if absent or not a non-negative int."""
    if not isinstance(kv_transfer_params, dict):
        return None
    stored = kv_transfer_params.get(STORED_TOKENS_KEY)
    return stored if isinstance(stored, int) and not isinstance(stored, bool) and stored >= 0 else None


# The decode's /metrics counter of loads with a mismatched block (streams included), one name for
# the connectors that count it (connectors/vllm/kv_verdicts.py) and pd-router's rotation.
KV_MISMATCHED_REQUESTS_METRIC = "vllm:pd_kv_mismatched_requests_total"
# An engine's count of the KV faults it injected (transfer/kv_faults.py, tests only): pd-router warns
# about a worker where it rises above 0.
KV_FAULTS_INJECTED_METRIC = "vllm:pd_kv_faults_injected_total"


class _PdKvOnly(msgspec.Struct, frozen=True):
    kv: KvVerdict | None = None


class _ParamsPdOnly(msgspec.Struct, frozen=True):
    pd: _PdKvOnly | None = None


class _AnswerKvOnly(msgspec.Struct, frozen=True):
    kv_transfer_params: _ParamsPdOnly | None = None


_answer_decoder = msgspec.json.Decoder(_AnswerKvOnly)


def kv_verdict_in_answer(payload: bytes) -> KvVerdict | None:
    """`kv_transfer_params.pd.kv` of a whole (non-streamed) answer body, decoding nothing else
    (every other field is skipped): None if absent or the body is not JSON, ValueError if the
    section is there but malformed. Cheap when absent: a byte search."""
    if payload.find(b'"kv_transfer_params"') < 0:  # (CPython 3.11's `bytes in bytes` raises and
        return None                                  # clears a TypeError first: find() does not)
    try:
        answer = _answer_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed pd.kv verdict: {exc}") from None
    except msgspec.DecodeError:
        return None
    params = answer.kv_transfer_params
    return params.pd.kv if params is not None and params.pd is not None else None
