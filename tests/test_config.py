"""Config: defaults validate, overrides apply, and bad keys are named."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from launch.checks import validate_run
from rlpipe.config import ConfigError, build_config, load_config
from rlpipe.task_config import MathTask, RemoteTask


def test_defaults_are_valid():
    cfg = build_config({}, environ={})
    validate_run(cfg)
    assert cfg.learner.is_mode == "token_tis" and cfg.learner.is_cap == 2.0
    assert (cfg.learner.eps_low, cfg.learner.eps_high) == (0.2, 0.28)
    # the extra loss terms are all off unless asked for
    assert cfg.learner.kl_coef == 0 and cfg.learner.entropy_coef == 0 and cfg.learner.loss == "ppo_clip"


def test_yaml_env_and_dotted_overrides_layer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  lr: 1.0e-5\n  groups_per_step: 8\nrollout:\n  precision: fp8\n")
    cfg = load_config(path, environ={"RLPIPE_LEARNER__LR": "2e-5", "RLPIPE_CACHE": "/x"}, **{"learner.ppo_epochs": 3})
    assert cfg.learner.lr == 2e-5 and cfg.learner.groups_per_step == 8
    assert cfg.rollout.precision == "fp8" and cfg.learner.ppo_epochs == 3


@pytest.mark.parametrize("data, field", [
    ({"learner": {"lrr": 1}}, "learner.lrr"),
    ({"learner": {"lr": "fast"}}, "learner.lr"),
    ({"rollout": {"precision": "fp4"}}, "rollout.precision"),
    ({"sampling": {"n": 0}}, "sampling.n"),
    ({"bogus": 1}, "bogus"),
    ({"learner": {"kl_coef": -0.1}}, "learner.kl_coef"),
    ({"learner": {"kl_estimator": "k4"}}, "learner.kl_estimator"),
    ({"learner": {"kl_in": "advantage"}}, "learner.kl_in"),
    ({"learner": {"entropy_coef": -0.01}}, "learner.entropy_coef"),
    ({"learner": {"icepop_beta": 1.0}}, "learner.icepop_beta"),
    ({"learner": {"icepop_alpha": 1.0}}, "learner.icepop_alpha"),
    ({"learner": {"icepop_alpha": 0}}, "learner.icepop_alpha"),
    ({"learner": {"loss": "dpo"}}, "learner.loss"),
    ({"learner": {"tool_imitation": 0.5}}, "learner.tool_imitation: set, but task.tool is not"),
    ({"learner": {"tool_imitation": -1}}, "learner.tool_imitation"),
    ({"learner": {"cispo_eps_high": -1}}, "learner.cispo_eps_high"),
    ({"rollout": {"fleet": ["int8", "fp4"]}}, "rollout.fleet.1"),
    ({"quant": {"int8": {"profil": "p"}}}, "quant.int8.profil"),
    ({"quant": {"int8": {"activations": "sometimes"}}}, "quant.int8.activations"),
    ({"quant": {"fp8": {"quantize_on": "gpu"}}}, "quant.fp8.quantize_on: Input tag 'gpu'"),
    ({"quant": {"fp8": {"quantize_on": "learner", "per_tensor": True}}}, "quant.fp8.per_tensor: Extra"),
    # the flat section of earlier versions: each key names where it went
    ({"quant": {"profile": "p"}}, "quant.profile: now quant.int8.profile"),
    ({"quant": {"int8_weights": "7bit"}}, "quant.int8_weights: now quant.int8.weights"),
    ({"quant": {"quantize_on": "learner"}}, "quant.quantize_on: now quant.fp8.quantize_on"),
])
def test_bad_keys_are_named(data, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_config(data, environ={})


def test_cross_role_rules():
    with pytest.raises(ConfigError, match="sampling.n"):  # a group needs 2 answers to compare
        build_config({"sampling": {"n": 1}}, environ={})
    with pytest.raises(ConfigError, match="learner.geo_low"):
        validate_run(build_config({"learner": {"geo_low": 3.0}}, environ={}))


def test_another_distribution_claiming_an_import_name_of_rlpipes_is_named_before_anything_starts(monkeypatch):
    """A project on PyPI called ``launch`` (or ``learner``, ``quant``) installs into the same folder as
    rlpipe's package of that name: the launch check names it, and this environment has none."""
    import importlib.metadata

    from launch.checks import install_problems

    assert install_problems() == ()
    real = importlib.metadata.packages_distributions()
    monkeypatch.setattr(importlib.metadata, "packages_distributions",
                        lambda: {**real, "launch": ["rlpipe", "launch"], "requests": ["requests"]})
    install_problems.cache_clear()  # read once a process: this one's installation changes here
    try:
        assert len(install_problems()) == 1
        with pytest.raises(ConfigError, match="the distribution launch also installs the import name 'launch'"):
            validate_run(build_config({}, environ={}))
    finally:
        install_problems.cache_clear()


def test_a_model_the_launch_check_cannot_build_is_a_config_error_naming_it(tmp_path, monkeypatch):
    """Whatever the launch check meets building the model (an MoE raised RuntimeError; see
    tests/test_cli_errors.py for a real one), the run is refused naming the model and the error,
    not ended by a traceback (issue 33 item 7)."""
    import weight_sync.names

    (tmp_path / "config.json").write_text("{}")

    def cannot(path):
        raise NotImplementedError("experts are fused")

    monkeypatch.setattr(weight_sync.names, "served_mismatch", cannot)
    with pytest.raises(ConfigError, match=f"model.path: {tmp_path} could not be loaded .*NotImplementedError: "
                                          "experts are fused"):
        validate_run(build_config({"model": {"path": str(tmp_path)}}, environ={}))


def test_a_sharded_learner_quantizes_but_is_refused_automatic_recalibration():
    two_ranks = {"learner": {"ranks": 2}}
    with pytest.raises(ConfigError, match=r"quant\.int8\.recalibrate: auto .* learner\.parallel: fsdp"):
        validate_run(build_config({**two_ranks, "rollout": {"fleet": ["int8", "bf16"]},
                                   "quant": {"int8": {"recalibrate": "auto"}}}, environ={}))
    validate_run(build_config({**two_ranks, "rollout": {"fleet": ["int8", "bf16"]}}, environ={}))  # warn: the default
    validate_run(build_config({**two_ranks, "rollout": {"precision": "fp8"},
                               "quant": {"fp8": {"quantize_on": "learner"}, "int8": {"recalibrate": "auto"}}},
                              environ={}))
    validate_run(build_config({"learner": {"ranks": 2, "parallel": "ddp"}, "rollout": {"precision": "int8"},
                               "quant": {"int8": {"recalibrate": "auto"}}}, environ={}))


def test_cli_names_the_bad_field_without_importing_the_engine():
    out = subprocess.run([sys.executable, "-m", "launch.cli", "demo", "--set", "learner.is_mode=magic"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "learner.is_mode" in out.stderr
    probe = ("import sys, launch.cli; code = launch.cli.main(['learner', '--set', 'sampling.n=zero']); "
             "print(code, 'torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False", "False"], out.stderr
    assert "sampling.n" in out.stderr


def test_shipped_configs_load_and_the_demo_config_is_the_defaults():
    from pathlib import Path

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        validate_run(load_config(path, environ={}))
    demo = configs[0].parent / "demo.yaml"
    assert load_config(demo, environ={}) == build_config({}, environ={})

    def missing(written: dict, defaults: dict, prefix: str = "") -> list[str]:
        return [f"{prefix}{k}" for k, v in defaults.items() if k not in written] + [
            key for k, v in defaults.items() if isinstance(v, dict) and v and isinstance(written.get(k), dict)
            for key in missing(written[k], v, f"{prefix}{k}.")]

    # "Every key of an rlpipe run with its default value": a key added to the config is added there
    assert not missing(yaml.safe_load(demo.read_text()), build_config({}, environ={}).model_dump(mode="json"))
    # ... and the keys of the other task types, commented (under task.type arith they are refused)
    section = demo.read_text().split("\ntask:", 1)[1].split("\nsampling:", 1)[0]
    listed = set(re.findall(r"^  (?:# )?(\w+):", section, re.M))
    assert not {key for variant in (MathTask, RemoteTask) for key in variant.model_fields} - listed


def test_role_cpus_give_each_role_its_cores_and_must_exist():
    from launch.demo import check_cpus, role_envs
    from launch.role_setup import parse_cpus

    assert parse_cpus("0,2-3") == [0, 2, 3] and parse_cpus("") == []
    cfg = build_config({}, environ={}, workers=2, **{"rollout.cpus": "0-3", "learner.cpus": "4-5"})
    workers, learner = role_envs(cfg)
    assert [(w["RLPIPE_CPU_AFFINITY"], w["OMP_NUM_THREADS"]) for w in workers] == [("0,1", "2"), ("2,3", "2")]
    assert learner == {"RLPIPE_CPU_AFFINITY": "4,5", "OMP_NUM_THREADS": "2"}
    assert role_envs(build_config({}, environ={}))[1] == {}  # unset: the learner is not pinned, as before
    assert not any("RLPIPE_NICE" in w for w in workers)  # apart from the learner: full priority

    shared = build_config({}, environ={}, workers=2, **{"rollout.cpus": "0-1", "learner.cpus": "1"})
    workers, _ = role_envs(shared)  # w1 shares the learner's core: it yields it
    assert [(w["RLPIPE_CPU_AFFINITY"], w.get("RLPIPE_NICE")) for w in workers] == [("0", None), ("1", "19")]
    code = "import os; from launch.role_setup import apply_cpu_affinity; apply_cpu_affinity(); print(os.nice(0))"
    niced = subprocess.run([sys.executable, "-c", code], env={**os.environ, **workers[1]}, capture_output=True,
                           text=True, check=True)
    assert niced.stdout.strip() == "19"  # applied where the role starts, before its engine process
    with pytest.raises(ConfigError, match="learner.cpus"):
        check_cpus(build_config({}, environ={}, **{"learner.cpus": "100000"}))
    with pytest.raises(ConfigError, match="rollout.cpus"):
        build_config({}, environ={}, **{"rollout.cpus": "first"})


def test_every_rlpipe_variable_the_code_or_its_files_name_is_read_not_refused():
    """``env_overrides`` refuses an RLPIPE_* name that is neither a config key nor in OTHER_ENV. A variable
    added in code (or a manifest, script or doc) but not to that list would make rlpipe refuse its own
    variable; this reads every RLPIPE_* name in the tree and parses each as the config would."""
    import re
    from pathlib import Path

    from rlpipe.config import OTHER_ENV, env_overrides

    root = Path(__file__).resolve().parent.parent
    names: set[str] = set()
    for folder in ("rlpipe", "learner", "launch", "rollout_service", "weight_sync", "quant", "bench", "scripts",
                   "deploy", "docs", "configs"):
        for path in (root / folder).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".sh", ".yaml", ".yml", ".md", ""}:
                names |= set(re.findall(r"\bRLPIPE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    assert {"RLPIPE_CRASH_AT", "RLPIPE_API_TOKEN", "RLPIPE_LEARNER__LR"} <= names  # the scan sees the tree
    from pydantic import BaseModel

    from rlpipe.config import RunConfig

    def is_key(path: list[str]) -> bool:
        model = RunConfig
        for part in path:
            field = model.model_fields.get(part) if isinstance(model, type) else None
            if field is None:
                return False
            model = field.annotation
        return not (isinstance(model, type) and issubclass(model, BaseModel))  # a value, not a whole section

    strays = [n for n in sorted(names - OTHER_ENV) if not is_key([p.lower() for p in n[len("RLPIPE_"):].split("__")])]
    assert not strays, f"named in the tree but neither a config key nor in rlpipe.config.OTHER_ENV: {strays}"
    with pytest.raises(ConfigError, match="RLPIPE_NOT_A_THING"):  # and one that is neither is refused
        env_overrides({"RLPIPE_NOT_A_THING": "1"})
