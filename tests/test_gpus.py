"""Each role's CUDA devices (launch/gpus.py) and the vLLM engine arguments a run passes
through (rollout_service/engine_args.py): the decisions rlpipe makes, on CPU, with device
counts given. That vLLM and torch open the devices they are shown is theirs."""

from __future__ import annotations

import pytest

from launch.checks import validate_run
from launch.gpus import plan_gpus
from rlpipe.config import ConfigError, build_config
from tests.test_cli_errors import assert_usage_error, rlpipe


def cfg_with(**settings):
    return build_config({}, environ={}, **settings)


def visible(plan, workers: int) -> tuple[str, list[str]]:
    return (plan.learner_env().get("CUDA_VISIBLE_DEVICES", ""),
            [plan.worker_env(i).get("CUDA_VISIBLE_DEVICES", "") for i in range(workers)])


def test_an_8_gpu_node_gives_the_learner_its_ranks_gpus_and_each_worker_its_own():
    cfg = cfg_with(workers=4, **{"learner.ranks": 4})
    assert visible(plan_gpus(cfg, 8), 4) == ("0,1,2,3", ["4", "5", "6", "7"])
    # A worker `rlpipe scale` adds beyond the slices shares one, round robin.
    assert plan_gpus(cfg, 8).worker_env(4)["CUDA_VISIBLE_DEVICES"] == "4"
    # Explicit lists: the learner's one per rank; the two may overlap (colocated on a GPU).
    cfg = cfg_with(workers=2, **{"learner.ranks": 2, "learner.gpus": "6-7", "rollout.gpus": "0,3"})
    assert visible(plan_gpus(cfg, 8), 2) == ("6,7", ["0", "3"])
    cfg = cfg_with(workers=1, **{"learner.gpus": "0", "rollout.gpus": "0"})
    assert visible(plan_gpus(cfg, 1), 1) == ("0", ["0"])
    # Only one list given: the learner takes the first devices the workers do not use.
    assert visible(plan_gpus(cfg_with(workers=2, **{"rollout.gpus": "0-1"}), 4), 2) == ("2", ["0", "1"])


def test_the_ids_are_the_launchers_own_visible_devices():
    """A launcher already limited to some GPUs (a container, a scheduler) numbers them from
    0 as torch does; its children must be given the names it was given."""
    cfg = cfg_with(workers=1)
    assert visible(plan_gpus(cfg, 2, visible="3,5"), 1) == ("3", ["5"])
    assert visible(plan_gpus(cfg, 2, visible="GPU-aa, GPU-bb"), 1) == ("GPU-aa", ["GPU-bb"])


def test_no_gpu_means_no_cuda_variable_and_gpu_keys_are_refused():
    assert visible(plan_gpus(cfg_with(workers=2), 0), 2) == ("", ["", ""])
    with pytest.raises(ConfigError, match=r"rollout.gpus: names GPUs \[0\], but this machine has no CUDA device"):
        plan_gpus(cfg_with(**{"rollout.gpus": 0}), 0)  # a lone number, as YAML and --set read `0`
    assert cfg_with(**{"learner.gpus": 1, "learner.cpus": 3}).learner.gpus == "1"


@pytest.mark.parametrize(("settings", "devices", "message"), [
    ({"learner.gpus": "9"}, 8, r"learner.gpus: GPUs \[9\] do not exist here \(devices 0-7\)"),
    ({"learner.gpus": "0-1"}, 8, "learner.gpus: 2 GPUs for learner.ranks 1: one GPU per rank"),
    ({"workers": 2}, 2, r"rollout.gpus: 1 GPUs \(\[1\]\) give 1 slice\(s\) of 1 for 2 workers; set rollout.gpus and "
                        "learner.gpus"),
    ({"workers": 1}, 1, "rollout.gpus: 0 GPUs"),  # one GPU: colocation is the user's call, not a silent default
    ({"workers": 3, "rollout.gpus": "0-1"}, 4, "name more GPUs or run fewer workers"),
    ({"rollout.gpus": "0-3", "learner.ranks": 2}, 4, "learner.gpus: learner.ranks 2 need 2 GPUs beside rollout.gpus"),
])
def test_a_plan_that_cannot_work_names_what_to_change(settings, devices, message):
    with pytest.raises(ConfigError, match=message):
        plan_gpus(cfg_with(**settings), devices)


def test_the_demo_refuses_gpus_this_machine_lacks_before_anything_starts(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    code, err = rlpipe("demo", "--runs-dir", str(tmp_path), "--set", "rollout.gpus=0")
    assert_usage_error(code, err, "rollout.gpus", "no CUDA device")
    assert not any(tmp_path.iterdir()), "nothing is made before the check"


def test_engine_arguments_are_checked_against_vllms_own():
    from rollout_service.engine_args import engine_args_problems

    assert engine_args_problems({"max_num_seqs": 64, "enable_prefix_caching": False,
                                 "gpu_memory_utilization": 0.5}) == []
    (typo,) = engine_args_problems({"max_num_seq": 64})
    assert typo.startswith("rollout.engine.max_num_seq: not a vLLM engine argument") and "max_num_seqs" in typo
    (own,) = engine_args_problems({"max_model_len": 4096})
    assert "rlpipe sets this engine argument; set rollout.max_model_len" in own
    (tp,) = engine_args_problems({"tensor_parallel_size": 2})  # under gloo
    assert tp.startswith("rollout.engine.tensor_parallel_size: 2: under gloo") and "sync.transport nccl" in tp
    assert engine_args_problems({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "nccl") == []
    (dp,) = engine_args_problems({"data_parallel_size": 2}, "nccl")
    assert dp.startswith("rollout.engine.data_parallel_size: 2: an engine's own data parallelism")
    assert engine_args_problems({"tensor_parallel_size": 1}) == []
    with pytest.raises(ConfigError, match="rollout.engine.max_num_seq: not a vLLM engine argument"):
        validate_run(cfg_with(**{"rollout.engine": {"max_num_seq": 8}}))


def test_engine_arguments_reach_the_engine_beside_rlpipes(toy_model_path):
    from quant.precision_profile import profile_for
    from rollout_service.engine import RolloutEngine

    cfg = cfg_with(**{"rollout.engine": {"max_num_seqs": 7, "enable_prefix_caching": False}})
    kwargs = RolloutEngine(toy_model_path, profile_for("bf16", cuda=False), cfg.rollout).engine_kwargs()
    assert kwargs["max_num_seqs"] == 7 and kwargs["enable_prefix_caching"] is False
    assert kwargs["model"] == toy_model_path and kwargs["logprobs_mode"] == "processed_logprobs"
    bad = cfg_with(**{"rollout.engine": {"seed": 3}})
    with pytest.raises(ConfigError, match="rollout.engine.seed: rlpipe sets"):
        RolloutEngine(toy_model_path, profile_for("bf16", cuda=False), bad.rollout).engine_kwargs()
