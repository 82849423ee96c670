"""ELDR through pd-router: once the prefill reports a prompt's experts, the decode leg goes to the
worker already running requests on the same experts (pd-mock-engine fakes the capture: token t
picks expert t mod 16)."""

from concurrent.futures import ThreadPoolExecutor

import requests

from tests.router.conftest import deployment, mocks, wait_until

CODE = [16 * i + e for i in range(20) for e in (0, 1, 2, 3)]      # experts 0-3
PROSE = [16 * i + e for i in range(20) for e in (8, 9, 10, 11)]    # experts 8-11


def post(router, prompt, max_tokens):
    body = {"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    resp = requests.post(f"{router.url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-pd-route"]


def decode_of(route: str) -> str:
    return route.split("decode=")[1].split(",")[0]


def test_eldr_sends_a_decode_where_its_experts_already_run():
    prefills, decodes = mocks("vllm", decodes=3, prefill_args=("--moe-experts", "2,16"),
                              decode_args=("--tpot-ms", "40"))
    with deployment(prefills, decodes, "--policy", "eldr", "--route-header", "full") as router, ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, router, CODE, 80)  # ~3 s of decoding: its footprint stays
        wait_until(lambda: sum(d.stats().get("remote_decodes", 0) for d in decodes) == 1,
                   what="the first decode leg")
        same = post(router, CODE[::-1], 2)          # same experts, other prompt
        other = post(router, PROSE, 2)
        route = first.result()
    assert decode_of(same) == decode_of(route)      # joined the busier worker: same experts
    assert decode_of(other) != decode_of(route)     # unrelated experts: least loaded elsewhere
    assert "decode (experts known)" in same
