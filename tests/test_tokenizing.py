"""The byte bound that refuses a text too long to fit before it is tokenized
(rollout_service/tokenizing.py, issue 33 item 13): it must never say a text makes more tokens
than it does (that would refuse a prompt that fits), on the toy's tokenizer (which drops
letters) and on SmolLM2's byte-level BPE; and it must take milliseconds where tokenizing takes
seconds. The live check, 48 concurrent 1 MB prompts against a worker, is in tests/test_api.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_service.tokenizing import TokenBound

SMOLLM = Path.home() / ".cache/rlpipe/models/smollm2-135m-instruct"
# Texts a bound could get wrong: runs a tokenizer merges or drops, special tokens written out,
# characters a normalizer composes, and every script the probes stand for.
TRICKY = ["12+30=" * 50, "hello world " * 50, " " * 500, "\n" * 300, "\t \r\n" * 100, "\x00\x01\x07" * 100,
          "<eos><bos><pad>" * 40, "<|im_start|>assistant\n<|im_end|>" * 20, "e\u0301" * 200, "=\u0338" * 100,
          "\u1100\u1161\u11a8" * 100, "中文字" * 100, "😀🧪" * 100, "ﬃ" * 200, "Ａ" * 200, "x" * 2000,
          "def f(x):\n    return x ** 2\n" * 30, "-" * 1000, "=" * 1000, "0" * 1000]


def tokenizers(toy_model_path):
    from transformers import AutoTokenizer

    out = {"toy": AutoTokenizer.from_pretrained(toy_model_path)}
    if (SMOLLM / "tokenizer.json").exists():
        out["smollm2"] = AutoTokenizer.from_pretrained(SMOLLM)
    return out


def tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def bounds(toy_model_path):
    return {name: (tok, TokenBound(tok)) for name, tok in tokenizers(toy_model_path).items()}


def test_the_bound_never_exceeds_the_tokens_of_tricky_texts(bounds):
    for name, (tok, bound) in bounds.items():
        for text in TRICKY:
            assert bound.least(text) <= tokens(tok, text), (name, text[:40])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=400) | st.text(alphabet="0123456789+-=*% <>eosbpad\n", max_size=400))
def test_the_bound_never_exceeds_the_tokens_of_any_text(bounds, text):
    for name, (tok, bound) in bounds.items():
        assert bound.least(text) <= tokens(tok, text), (name, text)


def test_a_megabyte_that_cannot_fit_is_known_in_milliseconds(bounds):
    """1 MB of digits and signs: the toy makes a token of each character (its worst case, about 4
    s to tokenize here); the bound says it cannot fit 64 tokens without tokenizing it."""
    tok, bound = bounds["toy"]
    text = "12+30=" * (1_000_000 // 6)
    t0 = time.perf_counter()
    why = bound.over(text, 63)
    elapsed = time.perf_counter() - t0
    assert why is not None and "makes at least" in why and elapsed < 0.5, (why, elapsed)
    assert bound.over("12+30=", 63) is None  # a short one is left to the tokenizer
    assert bound.least("hello" * 10_000) == 0  # letters the toy drops count for nothing
