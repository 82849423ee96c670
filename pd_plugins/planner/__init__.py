"""pd-planner: the prefill/decode split for a workload, from the cluster simulator (split.py),
with NVIDIA Dynamo's sizing rule as a baseline (dynamo_rule.py); docs/planner.md."""
