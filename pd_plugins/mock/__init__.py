"""`pd-mock-engine`: a fast fake engine that speaks vLLM's and SGLang's PD fields.

A fake, named as such: it stands in for engines in router tests and benchmarks, where a real
engine on two CPU cores would measure the engine instead of the router. It runs no model.
"""
