"""Launch-time checks that span roles, run once by the launcher (``rlpipe demo``, ``up``, each
role command of launch/cli.py, scripts/check_run.py) before anything starts: the model path,
:func:`validate_run`'s cross-role rules, a multi-turn task's environment and template, and
whether the learner's weights fit the workers' engine. Each role's own settings are checked
where they are parsed (rlpipe/config.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from rlpipe.config import ConfigError, RunConfig, sharded_problem
from rlpipe.paths import BUILTIN_NAMES, TOY_ARCHS, TOY_PREFIX
from rlpipe.task_config import MathTask
from rlpipe.teacher_check import teacher_problem
from rlpipe.transports import STAGED


def check_model_path(path: str | None, builds_toy: bool = True) -> None:
    """``model.path`` names a model, checked before anything starts (else a transformers
    traceback, after Redis and the engine): a Hugging Face model directory (with a
    config.json) or, where the command prepares one (``builds_toy``: demo, up, calibrate,
    build-model), null, a toy model's name (``toy-<arch>``, rlpipe/paths.py) or a built-in
    real model's (``smollm2-135m-instruct``, launch/builtin_models.py). A role (rollout,
    learner) loads the directory its launcher resolved."""
    names = ", ".join([TOY_PREFIX + a for a in TOY_ARCHS] + list(BUILTIN_NAMES))
    if path is None:
        if builds_toy:
            return
        raise ConfigError("model.path: not set; a role needs a model directory "
                          "(`rlpipe build-model` prepares the toy or a built-in one)")
    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file():
            return
        raise ConfigError(f"model.path: {path} has no config.json (not a Hugging Face model directory)")
    if builds_toy and (path in BUILTIN_NAMES or path.startswith(TOY_PREFIX) and path[len(TOY_PREFIX):] in TOY_ARCHS):
        return
    hint = f" nor a model rlpipe prepares ({names})" if builds_toy else ""
    raise ConfigError(f"model.path: {path} is not a directory{hint}")


def environment_problems(cfg: RunConfig) -> list[str]:
    """A multi-turn task that could not run: an environment that does not import, or no chat
    template to render its messages with (every worker would fail every group)."""
    from rollout_service.environments import load_environment

    problems = []
    try:
        load_environment(cfg.task.environment)
    except ConfigError as e:
        problems.append(str(e))
    tokenizer_config = Path(cfg.model.path) / "tokenizer_config.json" if cfg.model.path else None
    if not cfg.rollout.chat_template and tokenizer_config is not None and tokenizer_config.is_file() and \
            "chat_template" not in json.loads(tokenizer_config.read_text()) and \
            not (tokenizer_config.parent / "chat_template.jinja").is_file():
        problems.append(f"task.environment: episodes are chat sessions, and {cfg.model.path}'s tokenizer has no chat "
                        "template: set rollout.chat_template")
    return problems


def tool_problems(cfg: RunConfig) -> list[str]:
    """An in-turn tool (``task.tool``) that does not import, or that meets a setting it cannot
    run with: multi-turn episodes (their environment answers between turns instead). The toy's
    task has no ``tool`` key (its answers are one number, with no equation to pause in)."""
    if not cfg.task.tool:
        return ["eval.without_tool: only with task.tool"] if cfg.eval.without_tool else []
    from rollout_service.inline_tools import load_tool

    problems = []
    try:
        load_tool(cfg.task.tool)
    except ConfigError as e:
        problems.append(str(e))
    if cfg.task.environment:
        problems.append("task.tool: an in-turn tool writes into single-turn answers; with task.environment the "
                        "environment answers between turns instead (set one of the two)")
    return problems


def served_problem(path: str | None) -> str | None:
    """Why the learner's weights of the model at ``path`` would not load into the workers'
    engine (else every worker refuses every update and the run waits at step 0), or None.
    A model the check cannot build is named with its error: an MoE's weight conversion
    raised RuntimeError, and the launch ended in a traceback (issue 33 item 7)."""
    if not path or not (Path(path) / "config.json").is_file():
        return None
    from weight_sync.names import served_mismatch

    try:
        why = served_mismatch(path)
    except ValueError as e:
        why = str(e)
    except Exception as e:
        return f"model.path: {path} could not be loaded to check that its weights fit the workers' engine: " \
               f"{type(e).__name__}: {e}"
    return f"model.path: the learner's weights do not fit the workers' engine: {why}" if why else None


def routing_problem(cfg: RunConfig) -> str | None:
    """Why ``rollout.routing_replay`` cannot run on the run's model (no MoE layers, or a
    router the learner cannot replay: learner/routing.py), or None. The model is built on
    the meta device (weight_sync/names.py meta_model): no weights are read."""
    path = cfg.model.path
    if not cfg.rollout.routing_replay or not path or not (Path(path) / "config.json").is_file():
        return None
    from learner.routing import replay_problem
    from weight_sync.names import meta_model

    model = meta_model(path)
    if model is None:
        return None
    why = replay_problem(model)
    return f"rollout.routing_replay: {why} ({path})" if why else None


def is_moe(path: str | None) -> bool:
    """Whether the model at ``path`` is a mixture of experts, from its config.json alone."""
    config = Path(path) / "config.json" if path else None
    if config is None or not config.is_file():
        return False
    from rlpipe.schema import expert_count

    return expert_count(json.loads(config.read_text())) > 1


def moe_precision_problem(cfg: RunConfig) -> str | None:
    """Why the run's quantized rollout cannot serve its MoE model, or None. int8 and
    learner-side fp8 keep the experts bf16 (quant/int8.py ``UNQUANTIZED_MOE``), but vLLM's
    online fp8 quantizes them too, and without CUDA it has no fp8 MoE kernel: the engine
    would fail at start with a traceback. The check runs where the launcher runs; a launcher
    without CUDA is taken to start CPU workers (quant/precision_profile.py ``on_cuda``)."""
    if "fp8" not in cfg.rollout.precisions or cfg.quant.fp8.on_learner or not is_moe(cfg.model.path):
        return None
    from quant.precision_profile import on_cuda

    if on_cuda():
        return None
    return ("quant.fp8.quantize_on: worker (vLLM's online fp8) would quantize the experts of this mixture of "
            f"experts ({cfg.model.path}), and vLLM's CPU build has no fp8 MoE kernel; set "
            "quant.fp8.quantize_on=learner, which keeps the experts in bf16")


def lora_problems(cfg: RunConfig) -> list[str]:
    """Why ``learner.lora`` cannot run with the rest of the run (learner/lora.py): the learner
    trains on one base as served. (Versions travel as adapters over gloo: the transport's
    own resolution refuses nccl and ipc, weight_sync/transport_choice.py.)"""
    if not cfg.learner.lora.rank:
        return []
    problems = []
    if len(cfg.rollout.precisions) != 1:
        problems.append(f"learner.lora: the frozen base is served in one precision; the fleet mixes "
                        f"{', '.join(cfg.rollout.precisions)} (rollout.fleet)")
    if cfg.rollout.routing_replay:
        problems.append("learner.lora: not with rollout.routing_replay yet (the adapter-off reference "
                        "does not replay routes)")
    return problems


def data_problems(cfg: RunConfig) -> list[str]:
    """The task's rows, its reward and the held-out rows, read and imported as the workers will
    (before any engine starts, so a missing file or a reward that does not import is one line
    naming its key, not a worker's traceback minutes later)."""
    if cfg.task.type == "arith":
        return []
    from rlpipe.datasets import load_rows
    from rollout_service.tasks import make_task

    problems = []
    try:
        make_task(cfg.task)  # every row, task.template and task.instruction applied, task.reward imported
    except ConfigError as e:
        problems.append(str(e))
    except (OSError, ValueError) as e:
        math_reward = isinstance(cfg.task, MathTask) and cfg.task.reward
        key = "task.reward" if math_reward and "reward" in str(e) else "task.dataset"
        problems.append(f"{key}: {' '.join(str(e).split())}" if not str(e).startswith(key) else str(e))
    if cfg.eval.dataset:
        t = cfg.task
        try:
            load_rows(cfg.eval.dataset, t.prompt_field, t.answer_field, t.id_field, need_answer=True)
        except (OSError, ValueError) as e:
            problems.append(f"eval.dataset: {' '.join(str(e).split())}")
    return problems


@functools.lru_cache(maxsize=1)
def install_problems() -> tuple[str, ...]:
    """Another installed distribution that claims one of rlpipe's top-level import names (``launch``,
    ``learner`` and ``quant`` are names of other projects on PyPI too): both install files into the
    same folder, each overwrites the other's, and which code runs is an accident of install order.
    Read once a process (about a second: every installed distribution's file list)."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    problems = []
    for name in sorted(n for n, dists in owners.items() if "rlpipe" in dists):
        if others := sorted(set(owners[name]) - {"rlpipe"}):
            problems.append(f"installation: the distribution {', '.join(others)} also installs the import name "
                            f"'{name}', one of rlpipe's, and their files overwrite each other: uninstall it "
                            f"(pip uninstall {others[0]}) or give rlpipe a virtual environment of its own")
    return tuple(problems)


def validate_run(cfg: RunConfig) -> None:
    """Cross-role rules, checked once at launch."""
    problems = list(install_problems())
    if cfg.sampling.max_tokens > cfg.rollout.max_new_tokens:
        problems.append("sampling.max_tokens: exceeds rollout.max_new_tokens")
    if cfg.task.type == "arith" and cfg.task.arith_style == "worked":
        from rlpipe.arith import ArithmeticProblems

        need = ArithmeticProblems(digits=cfg.task.digits, ops=cfg.task.ops, size=cfg.task.size, style="worked",
                              seed=cfg.task.seed).max_target_chars() + 1  # + <eos>
        if cfg.sampling.max_tokens < need:
            # Else a correct worked answer is cut before its last number and scores 0: no signal to learn from.
            problems.append(f"sampling.max_tokens: task.arith_style 'worked' needs at least {need} here "
                            f"(the longest worked answer plus <eos>), got {cfg.sampling.max_tokens}")
    if cfg.learner.minibatches > cfg.learner.groups_per_step:
        problems.append("learner.minibatches: more minibatches than groups per step")
    if cfg.learner.geo_low >= cfg.learner.geo_high:
        problems.append("learner.geo_low: must be below learner.geo_high")
    if cfg.rollout.fleet and len(cfg.rollout.fleet) > cfg.workers:
        problems.append("rollout.fleet: lists more precisions than there are workers")
    if cfg.learner.retokenize and cfg.rollout.routing_replay:
        problems.append("learner.retokenize: re-tokenized answers have no recorded experts to replay; "
                        "set rollout.routing_replay: false, or learner.retokenize: false")
    if why := served_problem(cfg.model.path):
        problems.append(why)
    elif why := routing_problem(cfg):
        problems.append(why)
    if why := moe_precision_problem(cfg):
        problems.append(why)
    from weight_sync.transport_choice import role_transport

    try:
        transport = role_transport(cfg)
    except ConfigError as e:
        problems.append(str(e))
        transport = STAGED
    problems += lora_problems(cfg)
    if cfg.learner.teacher.path and (why := teacher_problem(cfg.learner.teacher.path, cfg.model.path)):
        problems.append(why)  # on-policy distillation: the teacher must read the student's ids
    if cfg.rollout.engine:
        from rollout_service.engine_args import engine_args_problems

        problems += engine_args_problems(cfg.rollout.engine, transport)
    sharded = cfg.learner.ranks > 1 and cfg.learner.parallel != "ddp"
    if why := sharded_problem(cfg, sharded):
        problems.append(why)
    if cfg.task.environment:
        problems += environment_problems(cfg)
    problems += tool_problems(cfg)
    if cfg.model.toy_tool_calls and cfg.task.environment != "calculator":
        problems.append("model.toy_tool_calls: the toy would be taught to call a calculator that only "
                        "task.environment: calculator answers")
    path = cfg.model.path
    if cfg.model.toy_tool_calls and path and not path.startswith(TOY_PREFIX) and \
            not (Path(path) / "rlpipe_toy.json").is_file():  # a toy the launcher built is its directory
        problems.append(f"model.toy_tool_calls: only a toy model is warm-started, and model.path is {path}")
    data = data_problems(cfg)
    problems += data
    if cfg.eval.every and cfg.task.type == "arith":
        problems.append("eval.every: held-out evaluation needs a dataset task (task.type math or remote)")
    elif cfg.eval.every and cfg.eval.dataset == cfg.task.dataset:
        problems.append("eval.dataset: the same as task.dataset; evaluate on held-out rows (e.g. gsm8k:test)")
    elif cfg.eval.every and cfg.task.type != "arith" and not cfg.eval.drop_shared and not data:
        from rlpipe.datasets import check_disjoint, load_rows

        t = cfg.task  # both sets are read with the task's fields, as the workers read them (a name has its own)
        try:  # else the held-out score measures memory, not learning
            check_disjoint(*(load_rows(d, t.prompt_field, t.answer_field, t.id_field, need_answer=False)
                             for d in (t.dataset, cfg.eval.dataset)), names=("task", "eval"))
        except ValueError as e:
            problems.append(f"eval.dataset: {e} (eval.drop_shared: true drops them from the held-out rows)")
        except OSError as e:
            problems.append(f"eval.dataset: cannot read it: {e}")
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))
