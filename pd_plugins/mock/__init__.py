"""`pd-mock-engine`: a fast fake engine that speaks vLLM's and SGLang's PD fields.

A fake, named as such: it stands in for engines in router tests and benchmarks, where a real
engine on two CPU cores would measure the engine instead of the router. It runs no model.

- engine.py: the HTTP server and its command line (parsing, faults, PD legs, streaming);
- timing.py: when tokens come (fixed delays), modelled.py: by the engine model (--latency-model);
- side_channel.py: the KV handshake between a prefill and its decode;
- answers.py, faults.py, experts.py, stats.py, kv_events.py: what it writes, breaks, fakes,
  counts and publishes;
- protocol.py, client.py: its own endpoints as clients (the replay, benchmarks) read them.
"""
