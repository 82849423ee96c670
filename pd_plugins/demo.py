"""`make demo`: a real PD-served completion on CPU.

Starts a tiny-model vLLM prefill server and decode server with PdNixlConnector (pull mode),
runs the two-step PD flow for a few prompts, and checks each answer against the decode server
serving the same prompt on its own (aggregated).
"""

from __future__ import annotations

import time

from pd_plugins.connectors.transfer_params import pd_section_of
from pd_plugins.testing.engine_harness import VllmServer, metric_value, nixl_config, start_all
from pd_plugins.testing.pd_client import PrefillTarget, completion, prefill
from pd_plugins.testing.tiny_models import ensure_tiny_model

PROMPTS = [
    "the router sends a prompt to the prefill engine and",
    "a decode worker reads the cache block from memory while the queue",
]


def main() -> None:
    model = ensure_tiny_model("tiny-llama")
    print(f"model: {model} (tiny random-weight Llama, float32)")
    prefill_server = VllmServer("prefill", model, "0", nixl_config("prefill", "pull"))
    decode_server = VllmServer("decode", model, "1", nixl_config("decode", "pull"))
    print("starting vLLM prefill (core 0) and decode (core 1) with PdNixlConnector ...")
    started = time.monotonic()
    start_all([prefill_server, decode_server])
    print(f"both healthy in {time.monotonic() - started:.0f}s; logs in {prefill_server.log_dir}")
    target = PrefillTarget(prefill_server.url)
    try:
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
            t0 = time.monotonic()
            params = prefill(target, body)
            ttft = time.monotonic() - t0
            answer = completion(decode_server.url, {**body, "kv_transfer_params": params}).json()
            local = completion(decode_server.url, body).json()
            pd_text, local_text = answer["choices"][0]["text"], local["choices"][0]["text"]
            section = pd_section_of(params)
            print(f"\nprompt:     {prompt!r}")
            print(f"PD output:  {pd_text!r}")
            print(f"prefill:    {section.prompt_tokens} prompt tokens, {section.cached_tokens} "
                  f"from its prefix cache, engine {section.engine_id[:8]}, {section.mode} mode, "
                  f"{len(params['remote_block_ids'][0])} KV blocks moved; prefill leg {ttft * 1e3:.0f} ms")
            print(f"aggregated: {'identical' if pd_text == local_text else 'DIFFERENT: ' + repr(local_text)}")
        transfers = metric_value(decode_server.metrics(), "vllm:nixl_xfer_time_seconds_count")
        print(f"\nNIXL transfers counted by the decode server: {transfers:.0f}")
    finally:
        prefill_server.stop()
        decode_server.stop()


if __name__ == "__main__":
    main()
