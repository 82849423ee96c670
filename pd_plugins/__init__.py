"""pd-plugins: prefill/decode disaggregation for vLLM and SGLang.

Importing this package is cheap and never imports an engine; the engine-specific pieces are
loaded by the engines' own plugin hooks (see ``vllm_plugin`` and ``sglang_plugin``).
"""

__version__ = "0.1.0"
