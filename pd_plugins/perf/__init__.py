"""Performance models for routing studies: a roofline of model and GPU, a per-instance engine model
with continuous batching, prefix cache and bounded KV, and the cluster simulator that runs the
router's own policies over it. The mock engine (`pd-mock-engine --latency-model`) runs the same
engine model behind HTTP."""
