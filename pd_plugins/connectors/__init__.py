"""KV connectors: engine-agnostic transfer pieces here, thin engine adapters in `vllm/`."""
