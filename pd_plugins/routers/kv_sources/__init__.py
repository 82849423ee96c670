"""Where the router learns which worker holds which prompt blocks: its KV data sources.

- events.py: a vLLM worker's KV events (ZMQ SUB), turned into the router's own block keys;
- pools.py: what a shared KV pool holds (PdShmConnector's pool read directly, an LMCache pool
  learned from the prefills' answers).

They feed policy/prefix_index.py, which only stores and matches keys for the scorers. Nothing is
imported here, so reading a pool does not load ZMQ.
"""
