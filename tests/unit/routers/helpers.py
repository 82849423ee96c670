"""Small builders for policy unit tests: a pool of workers with chosen state."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from aiohttp import web

from pd_plugins.routers.config import LatencySpec, WorkerSpec
from pd_plugins.routers.policy.base import PolicyContext, RequestInfo
from pd_plugins.routers.policy.latency_model import LatencyModels
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.routers.request import BadRequest
from pd_plugins.vocab.block_keys import block_keys
from pd_plugins.routers.workers import WorkerPool

BLOCK = 4


def context(prefills: int = 2, decodes: int = 2, **latency) -> PolicyContext:
    pool = WorkerPool()
    for i in range(prefills):
        pool.add(WorkerSpec(url=f"http://127.0.0.1:{8100 + i}"), "prefill")
    for i in range(decodes):
        pool.add(WorkerSpec(url=f"http://127.0.0.1:{8200 + i}"), "decode")
    return PolicyContext(pool, PrefixIndex(), LatencyModels(LatencySpec(**latency)), BLOCK)


def learn_priors(ctx: PolicyContext) -> PolicyContext:
    """Feed both latency lines `min_samples` samples on their priors: the same line, now fitted
    (the `slo` admission refuses nothing on the priors alone)."""
    for fit in (ctx.latency.prefill, ctx.latency.decode_step):
        a, b = fit.prior
        for i in range(fit.min_samples):
            x = 100.0 * (i + 1) if fit is ctx.latency.prefill else float(i + 1)
            fit.learn(x, a + b * x)
    return ctx


def request(tokens: list[int], **kw) -> RequestInfo:
    return RequestInfo(prompt_tokens=len(tokens), block_keys=block_keys(tokens, BLOCK), **kw)


@contextlib.asynccontextmanager
async def loopback_server(handlers: dict) -> AsyncIterator[int]:
    """A real aiohttp server on 127.0.0.1 while the block runs ({path: handler}, any method);
    yields its port."""
    app = web.Application()
    for path, handler in handlers.items():
        app.router.add_route("*", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]
    finally:
        await runner.cleanup()


@dataclass
class Target:
    """A model as parse_request sees it (request.ModelTarget; the router's is a ModelGroup)."""

    max_model_len: int | None = 512
    key_block_size: int | None = BLOCK
    tokenize: Callable[[str], list[int]] | None = None
    adapter_parents: dict[str, str] = field(default_factory=dict)


def serving(target: Target, *names: str) -> Callable[[str | None], Target]:
    """parse_request's select_model for one model: `target` for any of `names` (none: any name),
    404 for another, like Router.select_model."""
    def select(model: str | None) -> Target:
        if model is not None and names and model not in names:
            raise BadRequest(404, f"model {model!r} is not served here; available: "
                                  f"{', '.join(sorted(names))}", param="model")
        return target
    return select


def build_tokenizer(directory) -> str:
    """A real byte-level BPE tokenizer.json (tokenizers, trained on a few words in well under a
    second) in `directory`, as `--tokenizer` takes it; its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = "the quick brown fox jumps over the lazy dog and then some more words".split()
    tokenizer.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20,
                                  trainer=trainer)
    path = f"{directory}/tokenizer.json"
    tokenizer.save(path)
    return path
