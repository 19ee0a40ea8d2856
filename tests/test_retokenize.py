"""learner/retokenize.py: an answer's text tokenized again, aligned with the ids the engine sampled.

On SmolLM2's tokenizer (the calculator recipe's), with answers built the way the in-turn tool builds
them: the model's tokens, the tool's value tokenized on its own, the model's tokens again.
"""

from __future__ import annotations

import numpy as np
import pytest

from learner.retokenize import char_spans, retokenize, tool_boundaries


@pytest.fixture(scope="module")
def tok(real_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_path)


def answer(tok, *parts):
    """(ids, mask, logprobs): parts alternate model text and tool text, model first; each model token -0.5."""
    ids, mask = [], []
    for k, part in enumerate(parts):
        piece = tok(part, add_special_tokens=False)["input_ids"] if isinstance(part, str) else list(part)
        ids += piece
        mask += [1 - k % 2] * len(piece)
    mask = np.asarray(mask, dtype=np.uint8)
    return np.asarray(ids), mask, (-0.5 * mask).astype(np.float32)


def test_a_canonical_answer_with_a_tool_value_re_tokenizes_to_the_same_ids_and_books(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids, mask, lps = answer(tok, "The total is 45 * 4 =", " 180", [*tok(" dollars.", add_special_tokens=False)
                                                                     ["input_ids"], eos])
    r = retokenize(tok, ids, mask, lps)
    assert r.tokens.tolist() == ids.tolist() and not r.changed.any()
    assert r.mask.tolist() == mask.tolist() and np.allclose(r.logprobs, lps)


def test_a_split_the_model_sampled_off_canonical_is_merged_and_trained_with_the_summed_log_prob(tok):
    doll, ars = (tok(x, add_special_tokens=False)["input_ids"] for x in (" doll", "ars"))
    ids, mask, lps = answer(tok, "It is 3 * 4 =", " 12", [*doll, *ars])
    r = retokenize(tok, ids, mask, lps)
    merged = tok(" dollars", add_special_tokens=False)["input_ids"]
    assert len(merged) == 1 and r.tokens[-1] == merged[0] and r.changed.tolist().count(True) == 1
    assert r.mask[-1] == 1 and r.logprobs[-1] == pytest.approx(-0.5 * (len(doll) + len(ars)))
    assert r.mask[:-1].tolist() == mask[: len(r.tokens) - 1].tolist()  # the tokens before it keep their books


def test_a_tool_value_that_merges_with_the_models_text_is_a_changed_token_and_tool_only_text_stays_context(tok):
    # the model wrote "x" and the tool "yz" where the tokenizer reads "xyz" as one token would be trained; a token
    # of the tool's characters alone, changed or not, is never trained
    ids, mask, lps = answer(tok, " hel", "lo", " world")
    r = retokenize(tok, ids, mask, lps)
    hello = tok(" hello", add_special_tokens=False)["input_ids"]
    assert r.tokens[0] == hello[0] and r.changed[0] and r.mask[0] == 1  # sampled characters in it: trained
    assert r.logprobs[0] == pytest.approx(-0.5 * len(tok(" hel", add_special_tokens=False)["input_ids"]))
    ids, mask, lps = answer(tok, "a =", " 1 2")
    r = retokenize(tok, ids, mask, lps)
    model = len(tok("a =", add_special_tokens=False)["input_ids"])
    assert r.mask[:model].all() and not r.mask[model:].any() and r.logprobs[model:].sum() == 0


def test_spans_cover_the_decoded_text_and_boundaries_mark_the_first_model_token_after_a_tool(tok):
    ids = tok("Sam had 70 seashells.", add_special_tokens=False)["input_ids"]
    spans = char_spans(tok, ids)
    text = tok.decode(ids)
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert tool_boundaries(np.array([1, 1, 0, 0, 1, 1, 0, 1])).tolist() == [0, 0, 0, 0, 1, 0, 0, 1]


def test_the_learner_arm_rewrites_each_answer_of_a_record_and_carries_per_token_versions(tok, real_model_path):
    from learner.retokenize import Retokenizer
    from rlpipe.schema import GroupRecord, Sample

    doll, ars = (tok(x, add_special_tokens=False)["input_ids"] for x in (" doll", "ars"))
    ids, mask, lps = answer(tok, "It is 3 * 4 =", " 12", [*doll, *ars])
    versions = np.arange(len(ids), dtype=np.int32)
    rec = GroupRecord("r", "g", "p", "w", 0, len(ids), "bf16", "", {"temperature": 0.5}, np.array([1, 2], np.int32),
                      [Sample(ids.astype(np.int32), lps, "stop", 1.0, versions, mask=mask),
                       Sample(ids.astype(np.int32), lps, "stop", 0.0, None, mask=mask)])
    arm = Retokenizer(real_model_path)
    out = arm(rec)
    assert arm.changed == 2 and [s.reward for s in out.samples] == [1.0, 0.0]
    first = out.samples[0]
    assert len(first.tokens) == len(ids) - 1 and first.mask.tolist() == first.model_mask().astype(int).tolist()
    assert first.versions.tolist() == versions[:-1].tolist()  # " dollars" starts in " doll": its version
    assert out.samples[1].versions is None and rec.samples[0].tokens.tolist() == ids.tolist()  # the input is kept


def test_the_arm_is_refused_beside_routing_replay_before_anything_starts(toy_model_path):
    from launch.checks import validate_run
    from rlpipe.config import ConfigError, build_config

    cfg = build_config({}, environ={}, **{"model.path": toy_model_path, "learner.retokenize": True,
                                          "rollout.routing_replay": True})
    with pytest.raises(ConfigError, match="learner.retokenize: re-tokenized answers have no recorded experts"):
        validate_run(cfg)


def test_the_same_ids_are_unchanged_even_where_a_character_spans_two_tokens(tok):
    ids = np.asarray(tok("Price: 5 \U0001d538\U0001f9ee each", add_special_tokens=False)["input_ids"])
    mask = np.ones(len(ids), dtype=np.uint8)
    r = retokenize(tok, ids, mask, (-0.5 * mask).astype(np.float32))
    assert r.tokens.tolist() == ids.tolist() and not r.changed.any() and r.source.tolist() == list(range(len(ids)))
