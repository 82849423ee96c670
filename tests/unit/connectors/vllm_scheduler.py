"""vLLM's own scheduler with one of our connectors, built without a server or a model runner.

The scheduler, its KV cache manager, its requests (with vLLM's block hasher) and the connector's
scheduler side are all real; only the forward pass never happens, so tests drive what the engine
core would do on `add_request` and each `schedule()`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK_SIZE = 16
NUM_BLOCKS = 200


@functools.cache
def tiny_llama() -> str:
    from pd_plugins.testing.tiny_models import ensure_tiny_model

    return str(ensure_tiny_model("tiny-llama"))


def make_scheduler(kv_connector: str, kv_role: str, extra: dict[str, Any] | None = None,
                   engine_id: str | None = None, failure_policy: str = "fail",
                   tensor_parallel_size: int = 1):
    from pd_plugins.vllm_plugin import register

    register()
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = VllmConfig(
        model_config=ModelConfig(model=tiny_llama(), dtype="float32", seed=0, max_model_len=1024),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                         max_model_len=1024, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector=kv_connector, kv_role=kv_role,
                                            kv_buffer_device="cpu", engine_id=engine_id,
                                            kv_connector_extra_config=extra or {},
                                            kv_load_failure_policy=failure_policy),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    # the scheduler of a TP engine (set after validation, which would want a distributed setup)
    config.parallel_config.tensor_parallel_size = tensor_parallel_size
    config.parallel_config.world_size = tensor_parallel_size  # one pipeline stage
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=BLOCK_SIZE)


def make_request(request_id: str, prompt: list[int], extra_args: dict[str, Any] | None = None,
                 max_tokens: int = 4, **kwargs: Any):
    """A request as the engine core builds it (vLLM's block hasher, sha256 as by default)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(request_id=request_id, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra_args),
                   pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, hash_fn), **kwargs)


def sample_one_token(scheduler, output, token: int = 7, kv_connector_output=None
                     ) -> dict[str, Any]:
    """What the model runner would report after `output`'s step: one sampled token for each
    request that computed its whole prompt (vLLM's update_from_output then finishes those at
    max_tokens), and `kv_connector_output` (the connector workers' report) if given. Returns
    each finished request's outputs by request id."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]  # schedule() counted the step's tokens already
        sampled.append([token] if request.num_computed_tokens >= request.num_prompt_tokens else [])
    engine_outputs = scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled, kv_connector_output=kv_connector_output))
    return {out.request_id: out for outs in engine_outputs.values() for out in outs.outputs
            if out.finish_reason is not None}


def keep_scheduler_stats(connector, reports: list) -> None:
    """Appends a copy of every counter report the scheduler-side `connector` hands vLLM (vLLM
    collects and resets them each step) to `reports`."""
    import copy

    collect = connector.get_kv_connector_stats

    def keep_a_copy():
        stats = collect()
        if stats is not None:
            reports.append(copy.deepcopy(stats))
        return stats

    connector.get_kv_connector_stats = keep_a_copy


def counted(reports: list, key: str) -> float:
    """A counter as /metrics would show it: the sum over the workers' and the scheduler's
    reports (None: a step without any)."""
    return sum(sum(r.data.get(key, ())) for r in reports if r is not None)


def prefill_leg(engine, prompt: list[int], req_id: str, before_worker=None,
                steps: int = 1) -> dict:
    """A PD prefill leg (max 1 token) through `engine` (its `scheduler` and `step()`, which plays
    one engine step with the connector's worker side), finished within `steps` steps; the leg's
    answer (kv_transfer_params). `before_worker(meta)`: what happens elsewhere between its first
    schedule and the worker (engines whose step() takes it)."""
    from pd_plugins.vocab.transfer_params import prefill_flags

    engine.scheduler.add_request(make_request(req_id, prompt,
                                              {"kv_transfer_params": prefill_flags()},
                                              max_tokens=1))
    finished = engine.step(before_worker) if before_worker is not None else engine.step()
    for _ in range(steps - 1):
        if req_id in finished:
            break
        finished.update(engine.step())
    return finished[req_id].kv_transfer_params


def decode_leg(engine, prompt: list[int], params: dict | None, req_id: str = "d"):
    """A decode leg (max 1 token; `params`: its kv_transfer_params, None for a plain request)
    run until it ends; its final output."""
    extra = {"kv_transfer_params": params} if params is not None else None
    engine.scheduler.add_request(make_request(req_id, prompt, extra, max_tokens=1))
    for _ in range(3):
        finished = engine.step()
        if req_id in finished:
            return finished[req_id]
    raise AssertionError("the decode leg did not finish in three steps")


def computed_blocks(scheduler, output):
    """(prompt block index, engine block id) of every block a scheduled step computes (what a
    test that plays the forward pass's KV writes; blocks loaded instead are not computed)."""
    manager = scheduler.kv_cache_manager
    for req_id, tokens in output.num_scheduled_tokens.items():
        # the scheduler counted this step's tokens as computed already
        start = scheduler.requests[req_id].num_computed_tokens - tokens
        ids = manager.get_block_ids(req_id)[0]
        for block in range(start // BLOCK_SIZE, -(-(start + tokens) // BLOCK_SIZE)):
            yield block, ids[block]
