"""docs/your-model.md against the code: every config key it names exists, every YAML block of it is a
valid config, and its worked example (the files it shows, written out as they are) passes
scripts/check_run.py with the output the guide prints, scores as the guide says, and has its
overlapping held-out set refused. No engine, Redis or model: a few seconds.
"""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from rlpipe.config import RunConfig, build_config

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "your-model.md"
SECTIONS = {name for name, field in RunConfig.model_fields.items() if hasattr(type(field.default), "model_fields")}
# `section.key` written anywhere in the text (not a file name such as data/eval.jsonl)
KEY = re.compile(rf"(?<![\w/.-])({'|'.join(sorted(SECTIONS))})\.([a-z0-9_*]+(?:\.[a-z0-9_]+)*)")
BLOCK = re.compile(r"^```(\w*)(?: title=\"([^\"]+)\")?\n(.*?)^```", re.M | re.S)


def guide() -> str:
    return GUIDE.read_text(encoding="utf-8")


def blocks(language: str) -> list[tuple[str | None, str]]:
    return [(title or None, body) for lang, title, body in BLOCK.findall(guide()) if lang == language]


def worked_example(directory: Path) -> None:
    for lang in ("jsonl", "python", "yaml"):
        for title, body in blocks(lang):
            if title:
                (directory / title).parent.mkdir(parents=True, exist_ok=True)
                (directory / title).write_text(body)


def check_run(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_run.py"), *args], cwd=directory,
                          capture_output=True, text=True, timeout=60)


def test_every_key_the_guide_names_is_a_config_key():
    assert SECTIONS >= {"model", "task", "sampling", "rollout", "learner", "queue", "quant", "eval"}
    found = {m.group(0) for m in KEY.finditer(guide())}
    assert len(found) >= 40, sorted(found)
    unknown = []
    for key in sorted(found):
        nodes = [RunConfig]
        for part in key.split("."):
            if part == "*":
                break
            fields = [node.model_fields[part] for node in nodes if part in node.model_fields]
            if not fields:
                unknown.append(key)
                break
            # a section's model, or each variant of a tagged section (task.type's): the key is any one's
            nodes = [m for f in fields for m in (typing.get_args(f.annotation) or (f.annotation,))
                     if hasattr(m, "model_fields")]
    assert not unknown, f"docs/your-model.md names keys rlpipe/config.py does not have: {unknown}"


def test_every_yaml_block_is_a_valid_config():
    found = blocks("yaml")
    assert len(found) >= 2
    for title, body in found:
        build_config(yaml.safe_load(body), environ={})  # a ConfigError names the bad key


def test_the_worked_example_checks_as_the_guide_shows(tmp_path):
    worked_example(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()} == \
        {"data/train.jsonl", "data/eval.jsonl", "my_rewards.py", "my-run.yaml"}
    out = check_run(tmp_path, "my-run.yaml")
    assert out.returncode == 0, out.stderr
    # the transcript the guide prints, but its token count (that needs the model's tokenizer)
    (transcript,) = [body for _, body in blocks("") if "scripts/check_run.py my-run.yaml" in body]
    shown = [line for line in transcript.splitlines()[1:] if not line.startswith(("$", "prompt tokens:"))]
    assert out.stdout.splitlines() == shown


def test_the_worked_examples_reward_and_overlap_check(tmp_path, monkeypatch):
    worked_example(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # another test's module of the same name
    from my_rewards import last_number

    row = {"unit": "eggs"}
    assert last_number("", "7 boxes of 6 eggs: 42 eggs", "42", row) == (1.0, {"extracted": "42", "names_unit": True})
    assert last_number("", "6 x 7 = 43", "42", row)[0] == 0.0
    assert last_number("", "no idea", "42", row)[0] == 0.0
    # a held-out row that is also a training row (other spacing and case) is refused at launch, read with
    # the task's fields (prompt_field: question)
    train = (tmp_path / "data" / "train.jsonl").read_text().splitlines()
    with open(tmp_path / "data" / "eval.jsonl", "a") as f:
        f.write(train[1].replace("A train travels", "a train  travels").replace("train-1", "copy-1") + "\n")
    out = check_run(tmp_path, "my-run.yaml")
    assert out.returncode == 2
    assert "eval.dataset" in out.stderr and "share 1 question" in out.stderr and "copy-1" in out.stderr, out.stderr


@pytest.mark.parametrize("mistake, named", [
    ({"task": {"reward": "my_rewards:no_such_function"}}, "task.reward"),
    ({"task": {"template": "{prompt} in {units}"}}, "task.template"),
])
def test_check_run_names_the_mistake(tmp_path, mistake, named):
    worked_example(tmp_path)
    cfg = yaml.safe_load((tmp_path / "my-run.yaml").read_text())
    for section, values in mistake.items():
        cfg[section].update(values)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    out = check_run(tmp_path, "bad.yaml")
    assert out.returncode == 2 and named in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
