"""The built-in real model (SmolLM2-135M-Instruct, rlpipe/builtin_models.py) on the real engine.

Real prompts are long enough to be prefilled in chunks, which the toy's few-token prompts
never were: a seeded request that was chunk-prefilled killed vLLM's CPU engine
(``CPU Generator does not use offset``) until rollout_service/vllm_compat.py's
``rewind_cpu_generators``. The worker here has a token budget of 64 per engine step, so
every chat prompt below (about 80 tokens) is prefilled in at least two chunks.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rlpipe.paths import SMOLLM2
from tests.conftest import start_worker, stop_worker

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Give the final answer as a number at the end.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn? Give the final answer as a number at the end.",
]
STEP_TOKENS = 64


@pytest.fixture(scope="session")
def real_model_path() -> str:
    from rlpipe.builtin_models import ensure_builtin_model

    return str(ensure_builtin_model(SMOLLM2))


@pytest.fixture(scope="module")
def real_worker(redis_server, real_model_path, tmp_path_factory):
    cfg, proc, address = start_worker(redis_server.url, real_model_path, tmp_path_factory.mktemp("real-worker"), **{
        "rollout.precision": "bf16", "rollout.max_model_len": 512, "rollout.max_num_batched_tokens": STEP_TOKENS,
        "rollout.max_prompt_tokens": 256, "rollout.max_inflight_groups": 4, "sampling.n": 2})
    yield address
    stop_worker(proc)


def chat_ids(model_path: str, question: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


async def generate(address: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/v1/generate", json=b) for b in bodies))
    for reply in replies:
        assert reply.status_code == 200, reply.text
    return [reply.json() for reply in replies]


def tokens(reply: dict) -> list[list[int]]:
    return [c["tokens"] for c in reply["choices"]]


def test_seeded_chunk_prefilled_prompts_sample_the_same_however_they_are_chunked(real_worker, real_model_path):
    prompts = [chat_ids(real_model_path, q) for q in QUESTIONS]
    assert all(len(p) > STEP_TOKENS for p in prompts), [len(p) for p in prompts]
    body = {"prompt_token_ids": prompts[0], "n": 2, "max_tokens": 16, "seed": 7, "temperature": 1.0}
    (alone,) = asyncio.run(generate(real_worker, [body]))
    # Beside another long prompt, the first one's prefill is cut at other places.
    other, beside = asyncio.run(generate(real_worker, [{**body, "prompt_token_ids": prompts[1], "seed": 8}, body]))
    assert tokens(beside) == tokens(alone)
    (reseeded,) = asyncio.run(generate(real_worker, [{**body, "seed": 9}]))
    assert tokens(reseeded) != tokens(alone)  # the seed, not greedy decoding, fixes the samples
    assert httpx.get(f"http://{real_worker}/healthz", timeout=10).status_code == 200
