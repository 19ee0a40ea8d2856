"""Whether ``learner.teacher.path`` can grade the student's tokens: a model directory whose tokenizer
is the student's. The teacher scores the very ids the student sampled (learner/distillation.py), so an
id must mean the same text to both; a teacher with another vocabulary would grade noise, silently.

Checked at launch (launch/checks.py) and when the learner loads the teacher. Light on purpose: the
tokenizer.json files are compared as JSON (their vocabulary and added tokens), transformers is read
only for a tokenizer saved without one.
"""

from __future__ import annotations

import json
from pathlib import Path

KEY = "learner.teacher.path"


def teacher_problem(teacher: str, student: str | None) -> str | None:
    """Why ``teacher`` cannot teach the model at ``student`` (both model directories), naming the key
    and the file; None when it can. A ``student`` not yet a directory (a toy the launcher has still to
    build) is compared once it is one: validate_run runs again on the resolved path."""
    t = Path(teacher)
    if not t.is_dir():
        return f"{KEY}: {teacher} is not a directory (a Hugging Face model directory, as model.path)"
    if not (t / "config.json").is_file():
        return f"{KEY}: {teacher} has no config.json (not a Hugging Face model directory)"
    if not student or not Path(student).is_dir():
        return None
    s = Path(student)
    theirs, ours = _vocabulary(t), _vocabulary(s)
    if theirs is None:
        return f"{KEY}: {teacher} has no tokenizer (tokenizer.json or tokenizer_config.json)"
    if theirs == ours:
        return None
    by_id_theirs, by_id_ours = _by_id(theirs), _by_id(ours)
    ids = {i for i in by_id_theirs.keys() | by_id_ours.keys() if by_id_theirs.get(i) != by_id_ours.get(i)}
    where = t / "tokenizer.json" if (t / "tokenizer.json").is_file() else t / "tokenizer_config.json"
    return (f"{KEY}: {where}'s vocabulary is not the student's ({s}): {len(ids)} ids name other tokens "
            f"({len(theirs)} tokens against {len(ours)}); the teacher must share the student's tokenizer")


def _by_id(vocab: dict[str, int]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for token, i in vocab.items():
        out.setdefault(i, set()).add(token)
    return out


def _vocabulary(model_dir: Path) -> dict[str, int] | None:
    """token -> id over the tokenizer's whole vocabulary, added tokens included; None without a tokenizer."""
    path = model_dir / "tokenizer.json"
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = data.get("model", {}).get("vocab", {})
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
            vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
        return {**vocab, **{t["content"]: t["id"] for t in data.get("added_tokens", [])}}
    if not (model_dir / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(str(model_dir)).get_vocab())
