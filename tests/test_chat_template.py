"""Instruct models: ``task.chat_template`` wraps the prompt in the tokenizer's chat template (rollout_service.tasks).

The tokenizer is built here (character level, nothing downloaded) and, like the toy's, its post-processor prepends
``<bos>`` to whatever it tokenizes with special tokens; its chat template writes ``{{ bos_token }}`` itself. So a
prompt tokenized the wrong way (render the template, tokenize the string again with special tokens) starts with two
BOS, and the tests can tell.
"""

from __future__ import annotations

import asyncio
import json
import string
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from rlpipe.config import ConfigError, build_config
from rollout_service.tasks import PromptEncoder, make_task

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ROWS = [{"id": "a", "prompt": "What is 1+1?", "answer": "2"}, {"id": "b", "prompt": "Solve x^2=4, x>0.", "answer": "2"}]
SYSTEM = "You are a careful mathematician."


def build_tokenizer(out_dir, chat_template: str | None = TEMPLATE):
    """A character-level fast tokenizer with a ``<bos>`` post-processor and (optionally) a chat template, saved
    to ``out_dir`` and loaded back the way the worker loads it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + MARKERS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=MARKERS)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def task_cfg(dataset: str, **task):
    return build_config({"task": {"type": "math", "dataset": dataset, "shuffle": False,
                                  "template": "{prompt}\nPut the answer in \\boxed{{}}.", **task},
                         "rollout": {"max_model_len": 256}}, environ={})


def by_hand(tokenizer, text: str, system: str = "") -> list[int]:
    """The ids the template must give, spelled out: one BOS, the turns, the generation prompt."""
    ids = tokenizer.convert_tokens_to_ids
    turns = ([("<|system|>", system)] if system else []) + [("<|user|>", text)]
    out = [tokenizer.bos_token_id]
    for marker, content in turns:
        out += [ids(marker)] + [ids(c) for c in content] + [ids("<|end|>")]
    return out + [ids("<|assistant|>")]


@pytest.mark.parametrize("system", ["", SYSTEM], ids=["no_system", "system"])
def test_chat_prompt_ids_are_apply_chat_template_ids(tokenizer, dataset, system):
    cfg = task_cfg(dataset, chat_template=True, system_prompt=system)
    task, encode = make_task(cfg.task), PromptEncoder(cfg.task, tokenizer)
    for i in range(len(ROWS)):
        prompt = task.prompt(i)
        assert prompt.text == ROWS[i]["prompt"] + "\nPut the answer in \\boxed{}."  # task.template applied first
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt.text}]
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        ids = encode(prompt.text)
        assert ids == list(expected) == by_hand(tokenizer, prompt.text, system)
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
        # The mistake PromptEncoder avoids: the rendered string tokenized again gets the post-processor's BOS too.
        assert tokenizer(rendered)["input_ids"][:2] == [tokenizer.bos_token_id] * 2


def test_without_chat_template_the_prompt_is_tokenized_as_before(tokenizer, dataset):
    cfg = task_cfg(dataset)
    text = make_task(cfg.task).prompt(0).text
    ids = PromptEncoder(cfg.task, tokenizer)(text)
    assert ids == tokenizer(text)["input_ids"] and ids[0] == tokenizer.bos_token_id and ids.count(ids[0]) == 1
    assert tokenizer.convert_tokens_to_ids("<|user|>") not in ids


class FakeEngine:
    """Records the prompt ids it is given and returns fixed responses."""

    def __init__(self):
        self.profile = SimpleNamespace(precision="fp32", checkpoint=None)
        self.quant_profile = None
        self.given: list[list[int]] = []

    async def generate(self, prompt_ids, n, **kw):
        from rollout_service.engine import SampleResult

        self.given.append(list(prompt_ids))
        tokens = np.asarray([5, 6, 2], dtype=np.int32)
        return [SampleResult(tokens, np.zeros(3, np.float32), "stop", None) for _ in range(n)], 0, 0


def make_loop(cfg, tokenizer, engine=None):
    from rollout_service.loop import RolloutLoop
    from rollout_service.metrics import RolloutMetrics

    r = mock.MagicMock()
    r.info.return_value = {"run_id": "x"}
    queue = SimpleNamespace(r=r, keys=SimpleNamespace(sync_channel=lambda p: "sync"))
    return RolloutLoop(cfg, "w0", "", engine or FakeEngine(), queue, make_task(cfg.task), tokenizer,
                       RolloutMetrics("w0", "fp32"), on_fatal=lambda reason: None)


@pytest.mark.parametrize("system", ["", SYSTEM], ids=["no_system", "system"])
def test_record_keeps_the_prompt_ids_the_engine_was_given(tokenizer, dataset, system):
    from rollout_service.groups import Group

    cfg = task_cfg(dataset, chat_template=True, system_prompt=system)
    engine = FakeEngine()
    loop = make_loop(cfg, tokenizer, engine)
    record = asyncio.run(loop.generator(Group(index=1)))
    text = make_task(cfg.task).prompt(1).text
    assert engine.given == [by_hand(tokenizer, text, system)]
    assert record.prompt_tokens.dtype == np.int32 and record.prompt_tokens.tolist() == engine.given[0]
    assert record.prompt_id == "b" and record.prompt_tokens.tolist().count(tokenizer.bos_token_id) == 1


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_field(tmp_path, dataset):
    plain = build_tokenizer(tmp_path / "plain", chat_template=None)
    assert not plain.chat_template
    cfg = task_cfg(dataset, chat_template=True)
    with pytest.raises(ConfigError, match=r"task\.chat_template: the tokenizer of /some/model has no chat template"):
        PromptEncoder(cfg.task, plain, "/some/model")
    with pytest.raises(ConfigError, match=r"task\.chat_template"):
        make_loop(cfg, plain)
    PromptEncoder(task_cfg(dataset).task, plain)  # chat_template off: a plain tokenizer is fine


def test_worker_start_fails_naming_the_field_before_the_engine_starts(tmp_path, dataset, capsys):
    """``rlpipe rollout`` (rollout_service.server.serve) with a model whose tokenizer has no template: exit 2 with
    the field named, before the socket, Redis and the engine; the app's own start-up refuses it too."""
    from rollout_service.app import create_app
    from rollout_service.engine import RolloutEngine
    from rollout_service.server import serve

    build_tokenizer(tmp_path / "model", chat_template=None)
    cfg = build_config({"model": {"path": str(tmp_path / "model")}, "redis_url": "redis://127.0.0.1:1/0",
                        "rollout": {"precision": "fp32", "host": "127.0.0.1", "port": 0},
                        "task": {"type": "math", "dataset": dataset, "chat_template": True}}, environ={})
    with mock.patch.object(RolloutEngine, "start", side_effect=AssertionError("the engine must not start")) as start:
        with pytest.raises(SystemExit) as exit_:
            serve(cfg, "w0")
        assert exit_.value.code == 2
        assert "rlpipe: error: task.chat_template: the tokenizer of" in capsys.readouterr().err

        async def app_start():
            app = create_app(cfg.model_copy(update={"redis_url": ""}))
            async with app.router.lifespan_context(app):
                pass

        with pytest.raises(ConfigError, match=r"task\.chat_template: the tokenizer of .*model has no chat template"):
            asyncio.run(app_start())
    start.assert_not_called()


def test_calibration_prompts_use_the_chat_template(tokenizer_dir, tokenizer, dataset):
    from launch.demo import calibration_sequences

    cfg = task_cfg(dataset, chat_template=True, system_prompt=SYSTEM)
    cfg = cfg.model_copy(deep=True)
    cfg.quant.int8 = cfg.quant.int8.model_copy(update={"calibration_samples": 3, "probe_samples": 1})
    calib, probe = calibration_sequences(cfg, str(tokenizer_dir))
    task = make_task(cfg.task)
    for i, ids in enumerate(calib + probe):
        p = task.prompt(i)
        assert ids == by_hand(tokenizer, p.text, SYSTEM) + [tokenizer.convert_tokens_to_ids(c) for c in p.answer]


@pytest.mark.parametrize("task, field", [
    ({"type": "arith", "chat_template": True}, "task.chat_template"),
    ({"type": "math", "dataset": "d.jsonl", "system_prompt": "Be brief."}, "task.system_prompt"),
])
def test_config_rejects(task, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_config({"task": task}, environ={})


def test_config_accepts_chat_for_math_and_remote():
    cfg = build_config({"task": {"type": "math", "dataset": "d.jsonl", "chat_template": True,
                                 "system_prompt": SYSTEM}}, environ={})
    assert cfg.task.chat_template and cfg.task.system_prompt == SYSTEM
    cfg = build_config({"task": {"type": "remote", "dataset": "d.jsonl", "verifier_url": "http://v/score",
                                 "chat_template": True}}, environ={})
    assert cfg.task.chat_template and cfg.task.system_prompt == ""
    defaults = build_config({}, environ={}).task
    assert (defaults.chat_template, defaults.system_prompt) == (False, "")
