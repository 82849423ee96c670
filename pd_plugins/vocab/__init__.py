"""The words every part of pd-plugins shares: engines, router, mock, simulator and workloads.

A leaf package: no I/O, no engine imports, nothing from the rest of pd_plugins. Engine code (the
connectors, transfer and patches) imports these instead of the router's modules, so a vLLM worker
never loads router code.

- engines.py: the engine and transfer-mode names, and the engine load metrics the router reads;
- transfer_params.py: what we add to kv_transfer_params (the `pd` section, leg flags);
- block_keys.py: the chained prefix keys of a token sequence;
- expert_signature.py: a prompt's MoE expert choices in wire form (ELDR).
"""
