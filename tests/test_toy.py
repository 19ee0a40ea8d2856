"""The toy task and model: deterministic problems, an exact tokenizer, reproducible builds."""

from __future__ import annotations

import hashlib

from rlpipe.toy import EOS_ID, ArithmeticTask, ToyModelSpec, build_tokenizer, ensure_toy_model


def test_problems_are_a_pure_function_of_seed_and_index():
    task = ArithmeticTask(digits=2, ops="+-", seed=3, size=100)
    assert [task.problem(i) for i in range(20)] == [task.problem(i) for i in range(20)]
    assert task.problem(7) == task.problem(107)  # epochs wrap
    assert [task.problem(i) for i in range(20)] != [ArithmeticTask(seed=4).problem(i) for i in range(20)]
    for i in range(200):
        prompt, answer = task.problem(i)
        a, op, b = prompt[:-1].partition("+") if "+" in prompt else prompt[:-1].partition("-")
        assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert task.reward("42", "42") == 1.0 and task.reward("42", "41") == 0.0 and task.reward("42", "420") == 0.0


def test_character_tokenizer_round_trips(tmp_path):
    tok = build_tokenizer(tmp_path)
    ids = tok("12+345=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 8
    assert tok.decode(ids, skip_special_tokens=True) == "12+345="
    assert tok.decode([*tok("42")["input_ids"][1:], EOS_ID], skip_special_tokens=True) == "42"


def test_build_is_reproducible_and_cached(tmp_path):
    spec = ToyModelSpec(hidden_size=32, intermediate_size=64, num_heads=2, target_sampled_accuracy=0.5,
                        sft_max_steps=10, eval_every=5, eval_prompts=16, seed=5)
    a = ensure_toy_model(spec, root=tmp_path / "a", log=lambda m: None)
    b = ensure_toy_model(spec, root=tmp_path / "b", log=lambda m: None)

    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    assert digest(a) == digest(b)
    assert ensure_toy_model(spec, root=tmp_path / "a", log=lambda m: None) == a  # cached, not rebuilt
    assert not list((tmp_path / "a").glob(".build-*"))
