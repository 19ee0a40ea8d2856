"""The toy task and model: deterministic problems, an exact tokenizer, reproducible builds."""

from __future__ import annotations

import hashlib
import os

import pytest

from launch.toy import EOS_ID, ToyModelSpec, build_tokenizer, ensure_toy_model
from rlpipe.arith import ArithmeticProblems


def test_problems_are_a_pure_function_of_seed_and_index():
    task = ArithmeticProblems(digits=2, ops="+-", seed=3, size=100)
    assert [task.problem(i) for i in range(20)] == [task.problem(i) for i in range(20)]
    assert task.problem(7) == task.problem(107)  # epochs wrap
    assert [task.problem(i) for i in range(20)] != [ArithmeticProblems(seed=4).problem(i) for i in range(20)]
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


def test_llama_toy_has_its_own_lm_head_and_grouped_query_attention(tmp_path):
    """``model.path: toy-llama``: a LlamaForCausalLM with an untied head and 2 KV heads for 4
    query heads, the same tokenizer, cached under its own key (the Qwen2 toy's key unchanged)."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from launch.demo import resolve_model
    from launch.toy import toy_spec
    from rlpipe.config import ConfigError, build_config

    small = dict(hidden_size=32, intermediate_size=64, target_sampled_accuracy=0.5, sft_max_steps=10, eval_every=5,
                 eval_prompts=16, seed=5)
    path = ensure_toy_model(toy_spec("llama", **small), root=tmp_path, log=lambda m: None)
    config = json.loads((path / "config.json").read_text())
    assert path.name.startswith("toy-llama-") and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is False
    weights = load_file(path / "model.safetensors")
    assert weights["lm_head.weight"].shape == weights["model.embed_tokens.weight"].shape
    assert not (weights["lm_head.weight"] == weights["model.embed_tokens.weight"]).all()
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # 2 kv heads of 8
    assert AutoTokenizer.from_pretrained(path).get_vocab() == build_tokenizer(tmp_path / "tok").get_vocab()
    # The default toy keeps the key (and cache entry) it had before there was an arch.
    assert ToyModelSpec(task=ArithmeticProblems()).key() == toy_spec("qwen2", task=ArithmeticProblems()).key() \
        == "494a98eff854"
    assert toy_spec("llama").key() != ToyModelSpec().key()
    with pytest.raises(ConfigError, match="toy-llama"):
        resolve_model(build_config({}, environ={}, **{"model.path": "toy-gpt"}))


# --- task.arith_style: worked ------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, reward", [
    ("7+8=15 4+3+1=8 85", 1.0),  # the worked answer
    ("85", 1.0),  # the bare answer is a worked answer with no working
    ("7+8=15 4+3+1=8 085", 1.0),  # the number's value counts, not its spelling
    ("85 7+8=15 4+3+1=8", 0.0),  # only the last number counts
    ("8 8 8 8 8 8 8 8 85", 1.0),  # babble before the answer is free: length can grow
    ("85 85 85 85 85 84", 0.0),  # babble that ends wrong
    ("", 0.0), ("+= =*", 0.0),  # no number at all
    ("4-85", 1.0),  # a '-' after a digit is an operator, not a sign
    ("4 -85", 0.0), ("-85", 0.0),  # a sign: -85 is not 85
])
def test_worked_reward_reads_the_last_number(response, reward):
    assert ArithmeticProblems(style="worked").reward("85", response) == reward


def test_worked_reward_with_subtraction_and_negative_numbers():
    task = ArithmeticProblems(style="worked", ops="-")
    assert task.reward("0", "13-9=4 3-3=0") == 1.0 and task.reward("0", "3 -0") == 1.0
    assert task.reward("9", "17-8=9 3-3=0 -9") == 0.0  # answers are never negative here; -9 is wrong


def test_worked_targets_show_the_columns_and_end_in_the_answer():
    from rlpipe.arith import last_number, worked_steps

    assert worked_steps(47, "+", 38) == ["7+8=15", "4+3+1=8"]
    assert worked_steps(47, "-", 38) == ["17-8=9", "3-3=0"]
    assert worked_steps(47, "*", 38) == ["47*8=376", "47*30=1410"]
    task = ArithmeticProblems(style="worked", ops="+-*", size=300)
    for i in range(task.size):
        prompt, answer = task.problem(i)
        assert last_number(task.target(i)) == answer and task.reward(answer, task.target(i)) == 1.0
    assert ArithmeticProblems(style="worked").max_target_chars() == 19  # "9+8=17 5+8+1=14 147"
    assert ArithmeticProblems().target(3) == ArithmeticProblems().problem(3)[1]  # answer style: the bare answer
    with pytest.raises(ValueError, match="arith style"):
        ArithmeticProblems(style="essay")


def test_worked_warm_start_examples_round_trip_through_the_tokenizer(tmp_path):
    """Every character of a worked answer is in the toy alphabet: no <unk>, decoded back exactly."""
    from launch.toy import UNK_ID, sft_example

    tok = build_tokenizer(tmp_path)
    task = ArithmeticProblems(style="worked", ops="+-*", size=200)
    for i in range(task.size):
        prompt_ids, response_ids = sft_example(tok, task, i)
        assert UNK_ID not in prompt_ids + response_ids and response_ids[-1] == EOS_ID
        assert tok.decode(prompt_ids, skip_special_tokens=True) == task.problem(i)[0]
        assert tok.decode(response_ids, skip_special_tokens=True) == task.target(i)


def test_a_tool_warm_start_example_is_the_episode_the_calculator_session_holds(tmp_path):
    """The warm start's calling examples are, id for id, the episodes a session of the
    ``calculator`` environment holds under configs/toy-chat.jinja (a prompt, the call, the
    tool's reply, the answer), trained on the model's turns only; the tool share is part
    of the toy's key, and the toys without it keep theirs."""
    from launch.toy import UNK_ID, tool_example, toy_spec
    from tests.conftest import ROOT

    tok = build_tokenizer(tmp_path)
    template = (ROOT / "configs" / "toy-chat.jinja").read_text()
    task = ArithmeticProblems(ops="*")
    for i in range(50):
        prompt, answer = task.problem(i)
        ids, labels = tool_example(tok, task, i)
        messages = [{"role": "system", "content": "dropped"}, {"role": "user", "content": prompt},
                    {"role": "assistant", "content": prompt[:-1]}, {"role": "tool", "content": answer},
                    {"role": "assistant", "content": answer}]
        rendered = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=False)
        assert ids == list(rendered) and UNK_ID not in ids
        trained = tok.decode([t for t, y in zip(ids, labels) if y != -100])
        assert trained == f"{prompt[:-1]}<eos>{answer}<eos>"
    assert toy_spec(tool_calls=0.25).key() != toy_spec().key() == toy_spec(tool_calls=0.0).key()


def test_worked_style_is_its_own_toy_and_the_answer_toy_keeps_its_key():
    from launch.toy import toy_spec
    from rlpipe.config import build_config

    assert ToyModelSpec().key() == "494a98eff854"  # the key before arith_style existed: caches stay valid
    assert toy_spec(task=ArithmeticProblems(style="worked")).key() != ToyModelSpec().key()
    assert build_config({}, environ={}).task.arith_style == "answer"


def test_task_and_paths_are_core_modules_without_the_builder(tmp_path):
    """rollout_service and quant import the task (rlpipe.arith) and the cache (rlpipe.paths):
    neither may pull in the toy model builder, the roles or torch."""
    import subprocess
    import sys

    code = ("import sys, rlpipe.arith, rlpipe.paths; print(rlpipe.paths.cache_root()); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'learner', 'rollout_service', 'quant') or m == 'launch.toy'))")
    env = {**os.environ, "RLPIPE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == [str(tmp_path), "[]"]
