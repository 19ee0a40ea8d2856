"""The CLI's usage errors, and what a run leaves on disk.

Every mistake a user can make before anything starts (a config file, a ``--set`` value, the
model, a port, the runs directory) ends as one line naming it and exit code 2, checked
through the real ``rlpipe`` command, no traceback. A run started with a password in
``REDIS_URL`` writes it nowhere under its run directory, whose files are its owner's alone,
and its children still reach Redis.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rlpipe.config import build_config, load_config, secret_env, without_secrets
from tests.conftest import free_run_id, wait_for


def rlpipe(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})}, cwd=cwd)
    return out.returncode, out.stderr


def assert_usage_error(code: int, stderr: str, *names: str) -> None:
    """Exit 2, one line on stderr, naming every one of ``names``, and no traceback."""
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlpipe: error: "), stderr
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.fixture
def model_dir(tmp_path) -> str:
    """What the CLI takes for a model directory (it has a config.json): the commands below
    stop before anything loads it."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(tmp_path / "model")


def test_config_files_and_values_that_do_not_parse_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  lr: [1,\n")
    assert_usage_error(*rlpipe("learner", "--config", str(bad)), str(bad), "line 3")
    assert_usage_error(*rlpipe("demo", "--set", "learner.lr=[1,"), "--set learner.lr")
    assert_usage_error(*rlpipe("demo", env={"RLPIPE_LEARNER__LR": "{x"}), "RLPIPE_LEARNER__LR")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("seed: 1  # Müller\n".encode("latin-1"))
    assert_usage_error(*rlpipe("demo", "--config", str(latin)), str(latin), "UTF-8")
    assert_usage_error(*rlpipe("demo", "--config", str(tmp_path)), str(tmp_path))  # a directory
    # YAML reads these as a date and a boolean: the message says so and how to quote them
    assert_usage_error(*rlpipe("check", "--set", "run_id=2026-12-01"), "run_id", "a date: quote it")
    assert_usage_error(*rlpipe("check", "--set", "task.environment=no"), "task.environment", "a bool")
    # an RLPIPE_* name that is neither a config key nor one rlpipe reads is refused, not ignored in silence
    assert_usage_error(*rlpipe("check", env={"RLPIPE_STPES": "7"}), "RLPIPE_STPES: not a config key")
    assert_usage_error(*rlpipe("check", env={"RLPIPE_STEPS": "abc"}), "steps: Input should be a valid integer")


def test_a_model_path_that_is_no_model_is_named_before_anything_starts(tmp_path):
    assert_usage_error(*rlpipe("demo", "--set", f"model.path={tmp_path / 'nowhere'}"), "model.path", "toy-llama")
    # a role, which used to get as far as a transformers traceback (exit 3)
    assert_usage_error(*rlpipe("rollout", "--worker-id", "w0", "--set", f"model.path={tmp_path}"),
                       "model.path", "config.json")
    assert_usage_error(*rlpipe("learner"), "model.path")  # null: only the launchers build a toy


def test_a_learner_started_on_its_own_checks_the_run_as_the_launchers_do(model_dir):
    """On Kubernetes or Slurm nothing but the learner itself checks the run at launch."""
    assert_usage_error(*rlpipe("learner", "--set", f"model.path={model_dir}", "--set", "learner.geo_low=3"),
                       "learner.geo_low", "below learner.geo_high")


def test_routing_replay_on_a_model_without_experts_is_named(toy_model_path):
    """rollout.routing_replay on a dense model: nothing to record or replay (learner/routing.py)."""
    assert_usage_error(*rlpipe("learner", "--set", f"model.path={toy_model_path}", "--set",
                               "rollout.routing_replay=true"),
                       "rollout.routing_replay", "no mixture-of-experts layers")


def test_online_fp8_on_a_mixture_of_experts_is_named_with_the_setting_that_serves_it(tmp_path):
    """vLLM's online fp8 quantizes an MoE's experts, and its CPU build has no fp8 MoE kernel:
    the engine failed at start with a traceback (issue 36 item 4). Learner-side fp8 and int8
    keep the experts bf16 and pass the same check."""
    from tests.families import save_tiny_model

    path = save_tiny_model("qwen3_moe", tmp_path / "moe")
    assert_usage_error(*rlpipe("learner", "--set", f"model.path={path}", "--set", "rollout.precision=fp8"),
                       "quant.fp8.quantize_on", "fp8 MoE kernel", "quantize_on=learner")
    from launch.checks import moe_precision_problem

    for precision, on in (("fp8", "learner"), ("int8", "worker"), ("bf16", "worker")):
        cfg = build_config({}, environ={}, **{"model.path": path, "rollout.precision": precision,
                                              "quant.fp8.quantize_on": on})
        assert moe_precision_problem(cfg) is None, precision


def test_lora_with_what_it_cannot_serve_is_named(model_dir):
    """learner.lora trains on one served base and sends adapters over gloo (docs/lora.md)."""
    assert_usage_error(*rlpipe("demo", "--set", f"model.path={model_dir}", "--set", "learner.lora.rank=8",
                               "--precision", "int8,bf16"), "learner.lora", "int8, bf16")


def test_a_chat_template_file_that_is_not_there_is_named_before_the_worker_starts(toy_model_path, tmp_path):
    """rollout.chat_template naming no file ended the worker in its app's start-up, after the
    engine: uvicorn's exit 3 after a traceback (issue 33 item 7). It is read before the socket
    and the engine."""
    missing = tmp_path / "missing.jinja"
    assert_usage_error(*rlpipe("rollout", "--worker-id", "w0", "--set", f"model.path={toy_model_path}",
                               "--set", f"rollout.chat_template={missing}"), "rollout.chat_template", str(missing))


def test_a_model_the_launch_check_cannot_build_is_named(tmp_path):
    """The launch check reads the model's tensors to compare them with the engine's: one it
    cannot read (here a model.safetensors that is not one; before, a tiny Mixtral's weight
    conversion, which weight_sync/names.py now maps) printed a traceback; it is a config error
    naming the model and the error (issue 33 item 7)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"not a safetensors header")
    assert_usage_error(*rlpipe("learner", "--set", f"model.path={tmp_path / 'broken'}"),
                       "model.path", str(tmp_path / "broken"), "could not be loaded", "SafetensorError")


def test_a_port_in_use_is_named(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_usage_error(*rlpipe("rollout", "--worker-id", "w0", "--set", f"model.path={model_dir}",
                                   "--port", str(port)), "rollout.port", str(port))
        assert_usage_error(*rlpipe("learner", "--set", f"model.path={model_dir}", "--set", f"learner.port={port}"),
                           "learner.port", str(port))


def test_a_runs_dir_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "a-file").write_text("")
    assert_usage_error(*rlpipe("demo", "--runs-dir", str(tmp_path / "a-file" / "runs")), "--runs-dir", "a-file")
    if Path("/sys/kernel").is_dir():  # no mkdir there, even for root: PermissionError
        assert_usage_error(*rlpipe("up", "--runs-dir", "/sys/rlpipe-runs"), "--runs-dir", "/sys/rlpipe-runs")


def test_without_secrets_drops_the_password_and_secret_env_carries_it():
    cfg = build_config({}, environ={}, redis_url="redis://svc:p%40ss@redis:6379/0")
    assert without_secrets(cfg).redis_url == "redis://svc@redis:6379/0"
    assert secret_env(cfg) == {"RLPIPE_REDIS_PASSWORD": "p@ss"}  # decoded, as redis-py reads the URL
    assert cfg.redis_url.endswith("p%40ss@redis:6379/0")  # the launcher's own copy keeps it
    plain = build_config({}, environ={}, redis_url="redis://redis:6379/0")
    assert without_secrets(plain).redis_url == plain.redis_url and secret_env(plain) == {}


def test_a_run_writes_no_password_and_its_files_are_private(tmp_path, monkeypatch, toy_model_path):
    """The launcher's path (prepare_run, Launcher) with REDIS_URL=redis://:PW@host: a real
    Redis that requires PW, and a real learner child, which must get through to it."""
    from launch.demo import prepare_run
    from launch.launcher import Launcher
    from launch.redis_server import EmbeddedRedis
    from rlpipe.auth import SYNC_TOKEN_ENV
    from rlpipe.keys import Keys
    from rlpipe.redis_link import PASSWORD_ENV, PASSWORD_FILE_ENV, connect
    from rlpipe.registry import learner_state

    password = "pw-" + os.urandom(8).hex()
    for name in (PASSWORD_ENV, PASSWORD_FILE_ENV, SYNC_TOKEN_ENV, "RLPIPE_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with EmbeddedRedis(tmp_path / "redis", password=password) as server:
        monkeypatch.setenv("REDIS_URL", server.url.replace("redis://", f"redis://:{password}@"))
        cfg = build_config({}, environ={}, run_id=free_run_id("secret"), **{"model.path": toy_model_path})
        cfg, run_dir, embedded = prepare_run(cfg, str(tmp_path / "runs"), say=lambda m: None)
        assert embedded is None and password in cfg.redis_url
        launcher = Launcher(run_dir, secret_env(cfg))
        try:
            learner = launcher.spawn("learner", ["learner", "--config", str(run_dir / "config.yaml")])
            umask = next(line.split()[1] for line in Path(f"/proc/{learner.pid}/status").read_text().splitlines()
                         if line.startswith("Umask:"))
            r = connect(cfg.redis_url)
            wait_for(lambda: learner_state(r, Keys(cfg.run_id)).get("address") or launcher.check(), 120,
                     interval=0.2, what="the learner to reach Redis and publish its address")
        finally:
            launcher.stop_all(grace_s=1)  # a learner waiting for its first step: no need to wait
        token = launcher.secret_env[SYNC_TOKEN_ENV]
    assert load_config(run_dir / "config.yaml", environ={}).redis_url == server.url
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"config.yaml", "commands.txt", "learner.log"} <= {p.name for p in files}
    for path in files:
        data = path.read_bytes()
        assert password.encode() not in data and token.encode() not in data, path
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700 and umask == "0077"
    for name in ("config.yaml", "commands.txt", "logs/learner.log"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600, name


def test_a_folder_named_like_rlpipes_packages_in_the_working_directory_changes_nothing(tmp_path):
    """A role starts as `python -m launch.cli` in the user's directory; with PYTHONSAFEPATH (the
    launcher's role environment) their own launch/ or learner/ folder is not imported instead of
    rlpipe's, and their own reward module there still imports."""
    import subprocess
    import sys

    from launch.launcher import ROLE_ENV

    for package in ("launch", "learner"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("raise SystemExit('the user folder was imported')\n")
    (tmp_path / "my_rewards.py").write_text("def reward(*a):\n    return 1.0\n")
    probe = ("import sys; from launch import cli; cli._working_dir_last(); import learner.loss, my_rewards; "
             "print(cli.__file__, learner.loss.__file__, my_rewards.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONSAFEPATH": ROLE_ENV["PYTHONSAFEPATH"]})
    assert out.returncode == 0, out.stderr[-2000:]
    cli_file, loss_file, reward_file = out.stdout.split()
    assert not cli_file.startswith(str(tmp_path)) and not loss_file.startswith(str(tmp_path))
    assert reward_file.startswith(str(tmp_path))
    shadowed = subprocess.run([sys.executable, "-c", "import launch"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"})
    assert "the user folder was imported" in shadowed.stderr  # what it guards against


def test_a_missing_dataset_or_reward_is_named_before_any_engine_starts(tmp_path, model_dir):
    """Read and imported at launch as the workers would: one line naming the key, exit 2 (a worker
    used to fail minutes later, and the demo ended in a traceback)."""
    math = ["--set", f"model.path={model_dir}", "--set", "task.type=math", "--runs-dir", str(tmp_path / "runs")]
    assert_usage_error(*rlpipe("demo", *math, "--set", "task.dataset=missing.jsonl", cwd=tmp_path),
                       "task.dataset", "missing.jsonl")
    assert_usage_error(*rlpipe("demo", *math, "--set", "task.dataset=mawps:singleop", "--set",
                               "task.reward=nomodule:fn", cwd=tmp_path), "task.reward", "nomodule")
    assert_usage_error(*rlpipe("demo", *math, "--set", "task.dataset=mawps:singleop", "--set", "eval.every=5",
                               "--set", "eval.dataset=nothere.jsonl", cwd=tmp_path), "eval.dataset", "nothere.jsonl")
    (tmp_path / "my_reward.py").write_text("def fn(prompt, response, answer, row):\n    return 1.0\n")
    code, err = rlpipe("demo", *math, "--set", "task.dataset=missing.jsonl", "--set", "task.reward=my_reward:fn",
                       cwd=tmp_path)  # the user's reward in their directory imports; the missing file is what is named
    assert_usage_error(code, err, "task.dataset")
    assert "task.reward" not in err


def test_check_is_a_dry_run_that_names_mistakes_and_prints_the_resolved_config(tmp_path, model_dir):
    code, err = rlpipe("check", "--set", f"model.path={model_dir}", "--set", "task.type=math", "--set",
                       "task.dataset=missing.jsonl", cwd=tmp_path)
    assert_usage_error(code, err, "task.dataset", "missing.jsonl")
    out = subprocess.run([sys.executable, "-m", "launch.cli", "check", "--set", "rollout.precision=auto", "--set",
                          "steps=3"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    import yaml

    resolved = yaml.safe_load(out.stdout)
    assert resolved["steps"] == 3 and resolved["rollout"]["precision"] in ("fp32", "bf16")  # auto, resolved
    assert "# plan: 2 rollout workers" in out.stdout and "nothing was started" in out.stderr
    assert not (tmp_path / "runs").exists()
    version = subprocess.run([sys.executable, "-m", "launch.cli", "--version"], capture_output=True, text=True,
                             timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("rlpipe ")


def test_every_command_and_every_flag_of_the_cli_says_what_it_does():
    """``rlpipe <command> --help`` is a user's first reference: no flag is listed bare."""
    import argparse

    from launch.cli import _parser

    top = _parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    assert len(commands.choices) >= 10
    bare = [f"{name} {a.option_strings or a.dest}" for name, sub in commands.choices.items() for a in sub._actions
            if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not bare, bare
    assert all(c.help for c in commands._choices_actions)


def test_set_with_nothing_after_the_equals_sign_is_the_empty_string():
    from launch.cli import _overrides, _parser

    args = _parser().parse_args(["demo", "--set", "task.tool=", "--set", "eval.dataset=null", "--set", "learner.lr=0.001"])
    assert _overrides(args) == {"task.tool": "", "eval.dataset": None, "learner.lr": 0.001}
