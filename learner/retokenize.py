"""What a text-based trainer trains on: an episode's text tokenized again, aligned with what was sampled.

rlpipe trains on exactly the ids the engine saw (rollout_service/inline_tools.py). Many RL stacks do
not: they keep an agent episode as text (messages, tool calls, tool results), apply the chat template
again on the learner and tokenize the result. The two agree only where the text's canonical
tokenization is the one the model sampled. Where it is not (a tool's value tokenized apart from the
model's text around it; a non-canonical split the model happened to sample), the learner trains tokens
the policy never sampled. This module builds that second view of one answer, so the difference can be
measured (bench/tool_tokens.py) rather than argued.

The alignment is by characters: each new token either is an old token (the same id over the same
characters: it keeps that token's mask and behaviour log-prob), or is *changed*. A changed token is
trained (mask 1) when any of its characters was sampled by the model, and its behaviour log-prob is the
sum of the log-probs of the sampled tokens that start inside it: the probability of that text along
the path the engine took, the most a text-based trainer could know. A changed token made of the tool's
characters alone stays context (mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rlpipe.schema import GroupRecord


@dataclass
class Retokenized:
    tokens: np.ndarray  # (L',) int: the answer's text, tokenized again
    mask: np.ndarray  # (L',) uint8: 1 where a character of the token was sampled by the model
    logprobs: np.ndarray  # (L',) float32: the kept behaviour log-prob, or the sum over the sampled tokens inside
    changed: np.ndarray  # (L',) bool: not one of the sampled answer's tokens (another id, or other characters)
    source: np.ndarray  # (L',) int: the sampled token each new one starts in (for per-token versions)


def char_spans(tokenizer, tokens: list[int]) -> list[tuple[int, int]]:
    """Each token's characters in ``tokenizer.decode(tokens)``, from the decoded prefixes (a token
    that ends inside a multi-byte character gets an empty span; its bytes go to the next one)."""
    spans, end = [], 0
    for i in range(len(tokens)):
        new_end = len(tokenizer.decode(tokens[: i + 1], skip_special_tokens=False).rstrip("\ufffd"))
        spans.append((end, max(end, new_end)))
        end = max(end, new_end)
    return spans


def retokenize(tokenizer, tokens: np.ndarray, mask: np.ndarray, logprobs: np.ndarray) -> Retokenized:
    """The answer ``tokens`` (mask 1: sampled, 0: written by a tool) decoded to text and tokenized
    again (special tokens kept, as a chat template writes them), aligned as the module docstring says."""
    old = [int(t) for t in tokens]
    text = tokenizer.decode(old, skip_special_tokens=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    new, offsets = [int(t) for t in enc["input_ids"]], [tuple(o) for o in enc["offset_mapping"]]
    if new == old:  # the same ids (character spans may still disagree inside a multi-byte character)
        return Retokenized(np.asarray(old, dtype=np.int64), np.asarray(mask, dtype=np.uint8),
                           np.asarray(logprobs, dtype=np.float32), np.zeros(len(old), dtype=bool),
                           np.arange(len(old), dtype=np.int64))
    spans = char_spans(tokenizer, old)  # a decode per token: only for the answers that changed
    by_span = {(span, tok): i for i, (span, tok) in enumerate(zip(spans, old))}
    sampled_chars = np.zeros(len(text) + 1, dtype=bool)
    for (a, b), m in zip(spans, mask):
        sampled_chars[a:b] |= bool(m)
    starts = np.array([a for a, _ in spans]) if spans else np.zeros(0, dtype=int)
    out_mask, out_lp, changed = [], [], []
    source = np.clip(np.searchsorted(starts, [a for a, _ in offsets], side="right") - 1, 0, None)
    for tok, (a, b) in zip(new, offsets):
        i = by_span.get(((a, b), tok))
        if i is not None:
            out_mask.append(int(mask[i]))
            out_lp.append(float(logprobs[i]))
            changed.append(False)
            continue
        inside = [k for k in np.flatnonzero((starts >= a) & (starts < max(b, a + 1))) if mask[k]]
        out_mask.append(int(sampled_chars[a:b].any()))
        out_lp.append(float(sum(logprobs[k] for k in inside)))
        changed.append(True)
    return Retokenized(np.asarray(new, dtype=np.int64), np.asarray(out_mask, dtype=np.uint8),
                       np.asarray(out_lp, dtype=np.float32), np.asarray(changed, dtype=bool),
                       np.asarray(source, dtype=np.int64))


class Retokenizer:
    """``learner.retokenize``, a comparison arm: each record's answers as a text-based trainer trains them.
    Off by default; rlpipe trains the exact ids. ``changed`` counts the changed tokens it made."""

    def __init__(self, model_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.changed = 0

    def __call__(self, record: GroupRecord) -> GroupRecord:
        samples = []
        for s in record.samples:
            r = retokenize(self.tokenizer, s.tokens, s.model_mask().astype(np.uint8), s.logprobs)
            self.changed += int(r.changed.sum())
            versions = None if s.versions is None else np.asarray(s.versions)[r.source].astype(np.int32)
            samples.append(replace(s, tokens=r.tokens.astype(np.int32), logprobs=r.logprobs, mask=r.mask,
                                   versions=versions))
        return replace(record, samples=samples)


def tool_boundaries(mask: np.ndarray) -> np.ndarray:
    """(L,) bool: the sampled tokens right after a tool's text (the first model token of each resumption)."""
    m = np.asarray(mask).astype(bool)
    out = np.zeros_like(m)
    out[1:] = m[1:] & ~m[:-1]
    return out
