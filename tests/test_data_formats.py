"""Data as users have it (rlpipe/data_files.py, rlpipe/datasets.py): verl's and TRL's layouts unchanged, chat
prompts, dotted fields, and the files and folders Hugging Face ``datasets`` writes; bad rows named by row and field.
Every file is written here."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.config import ConfigError, build_config
from rlpipe.data_files import is_path, read_rows, split_of
from rlpipe.datasets import load_rows
from rlpipe.task_config import task_config
from rollout_service.tasks import PromptEncoder, make_task
from tests.test_chat_template import build_tokenizer

SUFFIX = ' Let\'s think step by step and output the final answer after "####".'
QUESTIONS = [("Tom has 3 apples and buys 4 more. How many?", "7"), ("A box holds 6 eggs. How many in 5 boxes?", "30")]


def verl_gsm8k(path, split: str = "train"):
    """verl's examples/data_preprocess/gsm8k.py layout: a chat prompt, the answer under reward_model."""
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q + SUFFIX}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": split, "index": i, "answer": f"... #### {a}", "question": q}}
            for i, (q, a) in enumerate(QUESTIONS)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def trl_conversational(path):
    """TRL's conversational prompt-only format, a system turn of its own, the answer in ``solution``."""
    rows = [{"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q}],
             "solution": a} for q, a in QUESTIONS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


def test_verls_gsm8k_parquet_loads_unchanged_its_chat_rendered_and_its_answer_a_dotted_field(tmp_path, tokenizer):
    cfg = task_config(type="math", dataset=verl_gsm8k(tmp_path / "train.parquet"), answer_field="reward_model.ground_truth",
                     id_field="extra_info.index", chat_template=True, answer_format="number", shuffle=False)
    task = make_task(cfg)
    p = task.prompt(1)
    assert (p.prompt_id, p.answer, p.text) == ("1", "30", QUESTIONS[1][0] + SUFFIX)
    assert p.messages == ({"role": "user", "content": p.text},)
    assert "data_source" in p.meta and "prompt" not in p.meta  # a remote verifier still gets the row's other fields
    ids = PromptEncoder(cfg, tokenizer)(p.text, p.messages)
    assert ids == tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    assert "[{" not in tokenizer.decode(ids)  # the chat, not its Python repr


def test_trls_conversational_rows_keep_their_system_turn_and_take_template_and_instruction(tmp_path, tokenizer):
    cfg = task_config(type="math", dataset=trl_conversational(tmp_path / "train.jsonl"), answer_field="solution",
                     chat_template=True, system_prompt="Ignored: the row has its own.", template="Q: {prompt}",
                     instruction="Put the final answer in \\boxed{}.", shuffle=False)
    p = make_task(cfg).prompt(0)
    assert p.text == f"Q: {QUESTIONS[0][0]}\nPut the final answer in \\boxed{{}}." and p.answer == "7"
    encode = PromptEncoder(cfg, tokenizer)
    assert encode.messages(p.text, p.messages) == [{"role": "system", "content": "Answer briefly."},
                                                   {"role": "user", "content": p.text}]
    # a text row gets task.system_prompt as before
    assert encode.messages("hi")[0] == {"role": "system", "content": "Ignored: the row has its own."}


def test_chat_rows_without_the_chat_template_are_refused_naming_the_key(tmp_path):
    cfg = task_config(type="math", dataset=verl_gsm8k(tmp_path / "t.parquet"), answer_field="reward_model.ground_truth")
    with pytest.raises(ValueError, match=r"task\.chat_template: .*row 0's prompt is a list of chat messages"):
        make_task(cfg)


@pytest.mark.parametrize("prompt, match", [
    ([{"role": "user"}], r"row 0: prompt field 'prompt' \(task\.prompt_field\): message 0 is not"),
    ([{"role": "robot", "content": "hi"}], "message 0 is not"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "the last message is the assistant"),
    ({"question": "hi"}, "expected text or a non-empty list of chat messages .*got dict"),
    ([], "got list"),
])
def test_a_bad_prompt_is_refused_with_its_row_and_field(tmp_path, prompt, match):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=match):
        load_rows(str(path))


def test_a_dotted_field_missing_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"row 0: missing answer field 'reward_model\.truth' \(task\.answer_field\)"):
        load_rows(verl_gsm8k(tmp_path / "t.parquet"), answer_field="reward_model.truth")


def test_hugging_face_files_and_folders_read_as_their_rows(tmp_path):
    import datasets

    rows = [{"prompt": q, "answer": a} for q, a in QUESTIONS]
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]),
                                  "test": datasets.Dataset.from_list(rows[1:])})
    saved.save_to_disk(str(tmp_path / "dict"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert read_rows(f"{tmp_path}/dict:test") == rows[1:] and read_rows(f"{tmp_path}/one") == rows
    with pytest.raises(ValueError, match=r"holds the splits train, test: choose one, e.g. .*dict:train"):
        read_rows(f"{tmp_path}/dict")
    with pytest.raises(ValueError, match=r"':dev' is not one of them"):
        read_rows(f"{tmp_path}/dict:dev")
    # a folder of data files, as a Hub snapshot has them: its splits from the file names
    (tmp_path / "snap" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "snap" / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1:]), tmp_path / "snap" / "data" / "test-00000-of-00001.parquet")
    assert read_rows(f"{tmp_path}/snap:train") == rows[:1]
    # single files in the formats the library reads
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "d.csv").write_text("prompt,answer\n" + "".join(f'"{q}",{a}\n' for q, a in QUESTIONS))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "x.parquet"))
    for name in ("d.json", "d.csv"):
        assert [str(r["answer"]) for r in read_rows(tmp_path / name)] == ["7", "30"], name
    arrow = next((tmp_path / "one").glob("*.arrow"))
    assert read_rows(arrow) == rows
    task = make_task(task_config(type="math", dataset=f"{tmp_path}/dict:train", shuffle=False))
    assert task.size == 1 and task.prompt(0).text == QUESTIONS[0][0]


def test_which_values_are_paths_and_what_a_missing_one_says(tmp_path):
    assert is_path("./my_set") and is_path("data/gsm8k:test") and is_path("rows.CSV") and not is_path("gsm8k:test")
    assert split_of("./my_set:test") == ("./my_set", "test") and split_of("C/d.jsonl") == ("C/d.jsonl", None)
    with pytest.raises(ConfigError, match=r"unknown dataset 'my_set'.*a folder's path holds a '/'"):
        build_config({"task": {"type": "math", "dataset": "my_set"}}, environ={})
    with pytest.raises(ValueError, match=r"no such file or folder .*a Hub id is not downloaded"):
        read_rows("openai/gsm8k")
    with pytest.raises(ValueError, match=r"chooses among a folder's splits"):
        read_rows(f"{tmp_path}/d.jsonl:train")



def toy_sums(layout: str, pairs: list) -> list[dict]:
    """The toy's sums as verl (Parquet columns) or TRL (a conversational prompt, the answer in ``solution``) keep them."""
    chat = [[{"role": "user", "content": f"{a}+{b}="}] for a, b in pairs]
    if layout == "verl":
        return [{"data_source": "toy", "prompt": c, "ability": "math", "extra_info": {"index": i},
                 "reward_model": {"style": "rule", "ground_truth": str(a + b)}}
                for i, (c, (a, b)) in enumerate(zip(chat, pairs))]
    return [{"prompt": c, "solution": str(a + b)} for c, (a, b) in zip(chat, pairs)]


@pytest.mark.parametrize("layout", ["verl", "trl"])
def test_verls_and_trls_rows_train_and_evaluate_through_the_demo_unchanged(tmp_path, toy_model_path, layout):
    """The whole path: the toy (its chat template written beside it) trains two steps on its sums in verl's
    Parquet layout or TRL's conversational JSONL, and is evaluated on held-out rows in the same layout."""
    import random
    import shutil
    from pathlib import Path

    from launch.demo import run_demo
    from learner.metrics import read_jsonl

    model = tmp_path / "toy"
    shutil.copytree(toy_model_path, model)
    (model / "chat_template.jinja").write_text((Path(__file__).parent.parent / "configs" / "toy-chat.jinja").read_text())
    pairs = [(a, b) for a in range(10, 50) for b in range(10, 50)]
    random.Random(0).shuffle(pairs)
    files = []
    for name, part in (("train", pairs[:64]), ("test", pairs[64:80])):
        rows = toy_sums(layout, part)
        if layout == "verl":
            pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
            files.append(str(tmp_path / f"{name}.parquet"))
        else:
            (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            files.append(str(tmp_path / f"{name}.jsonl"))
    fields = ({"task.answer_field": "reward_model.ground_truth", "task.id_field": "extra_info.index"}
              if layout == "verl" else {"task.answer_field": "solution"})
    cfg = build_config({}, environ={}, steps=2, workers=1, run_id=layout, **{
        "model.path": str(model), "task.type": "math", "task.dataset": files[0], "task.chat_template": True,
        "task.answer_format": "number", "sampling.max_tokens": 6, "learner.groups_per_step": 8, **fields,
        "eval.every": 2, "eval.dataset": files[1], "eval.size": 16, "eval.samples": 0})
    summary = run_demo(cfg, runs_dir=str(tmp_path / "runs"), progress=False)
    rows = read_jsonl(tmp_path / "runs" / layout / "metrics.jsonl")
    assert summary["completed"] and [r["learner_version"] for r in rows] == [1, 2]
    assert 0 < rows[0]["reward_mean"] < 1  # the toy's sums scored against the layout's answer field
    assert summary["eval_dataset"] == f"{files[1]} (16 rows)" and "eval_pass@1_end" in summary, summary
