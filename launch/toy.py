"""The tiny model that learns the toy task in minutes on two CPU cores.

Task: small-number arithmetic (``"37+45="`` -> ``"82"``) with an exact-match reward (rlpipe/arith.py).
Model: a ~0.5 M-parameter Qwen2 with a character-level tokenizer, warm-started by a short
supervised run until its *sampled* accuracy reaches a target (default 25%), so RL has a
signal to work with and plenty left to learn. With ``tool_calls`` a share of the warm
start's examples call the built-in calculator instead of answering (``37*48=`` -> the call
``37*48``, the environment's ``%1776=``, then ``1776``: configs/toy-chat.jinja's format), so
that the toy uses the tool sometimes and RL can teach it when. ``arch="llama"`` (``model.path: toy-llama``)
builds a Llama of the same size instead, with what the Qwen2 toy lacks: an untied LM head
and grouped-query attention (4 query heads sharing 2 KV heads), same tokenizer and recipe.
``arch="moe"`` (``model.path: toy-moe``) is a Qwen3-MoE with the Llama toy's attention and 4
experts a layer, 2 per token: a mixture of experts through the whole loop in minutes;
``arch="mixtral"`` (``toy-mixtral``) the same in Mixtral's layout.

Everything is made locally from a seed and cached under ``~/.cache/rlpipe`` (or
``$RLPIPE_CACHE``): no hub is ever contacted. vLLM and transformers load the result from
the directory like any Hugging Face checkpoint.

    python -m launch.toy /tmp/toy-model      # build (or reuse) and print its path
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlpipe.arith import ArithmeticProblems
from rlpipe.paths import TOY_ARCHS, cache_root

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARS = "0123456789+-*=% "
BUILD_FORMAT = 1  # bump to invalidate every cached toy model


@dataclass(frozen=True)
class ToyModelSpec:
    """Everything that determines the built model; its hash names the cache entry."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 512
    tie_word_embeddings: bool = True
    arch: str = "qwen2"  # or "llama": LlamaForCausalLM, "moe": Qwen3MoeForCausalLM, "mixtral"
    num_kv_heads: int = 0  # grouped-query attention; 0 = num_heads (plain multi-head)
    num_experts: int = 0  # "moe", "mixtral": experts a layer, each of intermediate_size
    experts_per_token: int = 0
    task: ArithmeticProblems = field(default_factory=ArithmeticProblems)
    seed: int = 0
    sft_batch: int = 64
    sft_lr: float = 1e-3
    sft_max_steps: int = 2000
    target_sampled_accuracy: float = 0.25
    eval_every: int = 25
    eval_prompts: int = 256
    tool_calls: float = 0.0  # the share of warm-start examples that call the calculator

    def __post_init__(self):
        if self.arch not in TOY_ARCHS:
            raise ValueError(f"toy model arch {self.arch!r}: one of {', '.join(TOY_ARCHS)}")
        kv = self.num_kv_heads or self.num_heads
        if self.hidden_size % self.num_heads or self.num_heads % kv:
            raise ValueError(f"toy model: {self.num_heads} heads must divide hidden_size {self.hidden_size} "
                             f"and be a multiple of {kv} kv heads")

    def key(self) -> str:
        spec = asdict(self)
        for name in ADDED_FIELDS:  # fields added later enter the hash only when set: old caches stay valid
            if spec[name] == ADDED_FIELDS[name]:
                del spec[name]
        for name in ADDED_TASK_FIELDS:
            if spec["task"][name] == ADDED_TASK_FIELDS[name]:
                del spec["task"][name]
        blob = json.dumps({"format": BUILD_FORMAT, **spec}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# Fields added to ToyModelSpec after BUILD_FORMAT 1, with the default that keeps a spec's old key.
ADDED_FIELDS = {"arch": "qwen2", "num_kv_heads": 0, "tool_calls": 0.0, "num_experts": 0, "experts_per_token": 0}
ADDED_TASK_FIELDS = {"style": "answer"}  # the same for ArithmeticProblems's fields
# The demo's own toy model (default config, seed 0): built once, reused by the demo, the tests
# and the benches.
TOY_SPEC = ToyModelSpec(task=ArithmeticProblems())


def ensure_toy_model(spec: ToyModelSpec | None = None, root: Path | None = None, log=print) -> Path:
    """Return the directory of the toy model for ``spec``, building it once if needed.

    The build writes into a temporary sibling and renames it into place, so a crashed or
    concurrent build never leaves a half-written model behind.
    """
    spec = spec or ToyModelSpec()
    root = Path(root) if root else cache_root() / "models"
    target = root / f"toy-{spec.arch}-{spec.key()}"
    if (target / "rlpipe_toy.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        build_toy_model(tmp, spec, log=log)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "rlpipe_toy.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tokenizer(out_dir: Path):
    """Write a character-level fast tokenizer that prepends ``<bos>`` to every prompt."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=64,
    )
    fast.save_pretrained(out_dir)
    return fast


def build_toy_model(out_dir: Path, spec: ToyModelSpec, log=print) -> None:
    """Build tokenizer + model into ``out_dir`` and warm-start the model on correct examples."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir)
    torch.manual_seed(spec.seed)
    config = toy_config(spec)
    model = getattr(transformers, TOY_MODEL_CLASSES[spec.arch])(config).float()
    t0 = time.time()
    steps, acc = warm_start(model, tokenizer, spec, log=log)
    log(f"[toy] warm start: {steps} steps, sampled accuracy {acc:.2f}, {time.time() - t0:.0f}s")
    model.save_pretrained(out_dir, safe_serialization=True)
    generation = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    generation.save_pretrained(out_dir)
    info = {"spec": asdict(spec), "key": spec.key(), "sft_steps": steps, "sampled_accuracy": acc}
    if spec.tool_calls:
        info["tool_call_rate"] = evaluate_with_tool(model, tokenizer, spec.task, spec.eval_prompts,
                                                    torch.Generator().manual_seed(spec.seed))[1]
    (out_dir / "rlpipe_toy.json").write_text(json.dumps(info, indent=2))


TOY_MODEL_CLASSES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "moe": "Qwen3MoeForCausalLM",
                     "mixtral": "MixtralForCausalLM"}


def toy_config(spec: ToyModelSpec):
    """The transformers config of ``spec``'s architecture. The MoE toy's every layer is
    sparse, its experts ``intermediate_size`` wide, with the routing weights renormalized
    over the chosen experts (``norm_topk_prob``), as Qwen3-MoE's released models do."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3MoeConfig

    fields = dict(vocab_size=len(SPECIAL_TOKENS) + len(CHARS), hidden_size=spec.hidden_size,
                  intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads or spec.num_heads,
                  max_position_embeddings=64, tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=BOS_ID,
                  eos_token_id=EOS_ID, pad_token_id=PAD_ID, rope_theta=10000.0)
    if spec.arch == "mixtral":
        return MixtralConfig(**fields, head_dim=spec.hidden_size // spec.num_heads,
                             num_local_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token)
    if spec.arch != "moe":
        return {"qwen2": Qwen2Config, "llama": LlamaConfig}[spec.arch](**fields)
    return Qwen3MoeConfig(**fields, head_dim=spec.hidden_size // spec.num_heads,
                          moe_intermediate_size=spec.intermediate_size, num_experts=spec.num_experts,
                          num_experts_per_tok=spec.experts_per_token, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[])


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def sft_example(tokenizer, task: ArithmeticProblems, index: int) -> tuple[list[int], list[int]]:
    """``(prompt ids, response ids)`` of one warm-start example: the target, then ``<eos>``."""
    prompt, _ = task.problem(index)
    return encode(tokenizer, prompt), encode(tokenizer, task.target(index))[1:] + [EOS_ID]  # drop the target's <bos>


def pieces(tokenizer, text: str) -> list[int]:
    """``text``'s ids without the ``<bos>`` the tokenizer puts before a prompt."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tool_reply(tokenizer, content: str) -> list[int]:
    """The ids of a tool message as configs/toy-chat.jinja renders it: ``%content=``."""
    return pieces(tokenizer, f"%{content}=")


def tool_example(tokenizer, task: ArithmeticProblems, index: int) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of one warm-start episode that calls the calculator: the prompt,
    the model's call (the problem without its ``=``) and ``<eos>``, the tool's reply as the
    toy's chat template renders it (``%value=``, context: label -100), then the value and
    ``<eos>``. Exactly the ids a session of the ``calculator`` environment holds."""
    prompt, answer = task.problem(index)
    call, reply, final = pieces(tokenizer, prompt[:-1]) + [EOS_ID], tool_reply(tokenizer, answer), \
        pieces(tokenizer, answer) + [EOS_ID]
    context = encode(tokenizer, prompt)
    return context + call + reply + final, [-100] * len(context) + call + [-100] * len(reply) + final


def warm_start(model, tokenizer, spec: ToyModelSpec, log=print) -> tuple[int, float]:
    """Supervised steps on correct examples until sampled accuracy reaches the target
    (with ``tool_calls``, the accuracy of episodes that may call the calculator).

    Training problems are drawn from a seed stream disjoint from the RL dataset's indices.
    Returns ``(steps, sampled_accuracy)``.
    """
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    rng = random.Random(f"sft:{spec.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr)

    def accuracy() -> float:
        if spec.tool_calls:
            return evaluate_with_tool(model, tokenizer, spec.task, spec.eval_prompts, gen)[0]
        return evaluate_sampled(model, tokenizer, spec.task, spec.eval_prompts, gen)

    acc = accuracy()
    step = 0
    while acc < spec.target_sampled_accuracy and step < spec.sft_max_steps:
        model.train()
        ids, labels = [], []
        for _ in range(spec.sft_batch):
            index = rng.randrange(10**9)
            if spec.tool_calls and rng.random() < spec.tool_calls:
                x, y = tool_example(tokenizer, spec.task, index)
            else:
                p, a = sft_example(tokenizer, spec.task, index)
                x, y = p + a, [-100] * len(p) + a
            ids.append(x)
            labels.append(y)
        width = max(map(len, ids))
        input_ids = torch.tensor([x + [PAD_ID] * (width - len(x)) for x in ids])
        label_ids = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        loss = model(input_ids=input_ids, attention_mask=(input_ids != PAD_ID).long(), labels=label_ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % spec.eval_every == 0:
            acc = accuracy()
            log(f"[toy] sft step {step}: loss {loss.item():.3f}, sampled accuracy {acc:.2f}")
    model.eval()
    return step, acc


def sample_responses(model, tokenizer, prompts: list[str], gen, temperature: float = 1.0, max_tokens: int = 8):
    """Plain-PyTorch batched sampling (the warm start must not depend on vLLM)."""
    out = sample_ids(model, [encode(tokenizer, p) for p in prompts], gen, temperature, max_tokens)
    return [tokenizer.decode(o) for o in out]


def sample_ids(model, encoded: list[list[int]], gen, temperature: float = 1.0, max_tokens: int = 8):
    """:func:`sample_responses` from prompt ids to response ids (without the ``<eos>``)."""
    import torch

    model.eval()
    width = max(map(len, encoded))
    # Left-pad so every sequence's next token sits at the last position.
    input_ids = torch.tensor([[PAD_ID] * (width - len(e)) + e for e in encoded])
    attention = (input_ids != PAD_ID).long()
    done = torch.zeros(len(encoded), dtype=torch.bool)
    out = [[] for _ in encoded]
    with torch.no_grad():
        for _ in range(max_tokens):
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits[:, -1]
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            else:
                nxt = logits.argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    if t == EOS_ID:
                        done[i] = True
                    else:
                        out[i].append(t)
            if done.all():
                break
            input_ids = torch.cat([input_ids, nxt[:, None]], 1)
            attention = torch.cat([attention, torch.ones_like(nxt[:, None])], 1)
    return out


def evaluate_sampled(model, tokenizer, task: ArithmeticProblems, n: int, gen, temperature: float = 1.0) -> float:
    problems = [task.problem(i) for i in range(n)]
    # Room for the longest target (8 as before for plain answers), so a correct worked answer is never cut short.
    max_tokens = max(8, max(len(task.target(i)) for i in range(n)) + 1)
    responses = sample_responses(model, tokenizer, [p for p, _ in problems], gen, temperature, max_tokens)
    return sum(task.reward(a, r) for (_, a), r in zip(problems, responses)) / n


def evaluate_with_tool(model, tokenizer, task: ArithmeticProblems, n: int, gen, temperature: float = 1.0):
    """``(accuracy, call rate)`` of episodes of the ``calculator`` environment on the first
    ``n`` problems, judged by the environment itself: a first turn that calls it gets its
    reply (:func:`tool_reply`) and a second turn; otherwise the first turn is the answer."""
    from rollout_service.environments import CalculatorEnv

    problems = [task.problem(i) for i in range(n)]
    max_tokens = max(8, max(len(p) for p, _ in problems))
    prompts = [encode(tokenizer, p) for p, _ in problems]
    envs = [CalculatorEnv(answer) for _, answer in problems]
    first = sample_ids(model, prompts, gen, temperature, max_tokens)
    steps = [env.step(tokenizer.decode(ids)) for env, ids in zip(envs, first)]
    calls = [i for i, step in enumerate(steps) if not step.done]
    if calls:
        again = [prompts[i] + first[i] + [EOS_ID] + tool_reply(tokenizer, steps[i].observation["content"])
                 for i in calls]
        for i, ids in zip(calls, sample_ids(model, again, gen, temperature, max_tokens)):
            steps[i] = envs[i].step(tokenizer.decode(ids))
    return sum(step.reward for step in steps) / n, len(calls) / n


def toy_spec(arch: str = "qwen2", **fields) -> ToyModelSpec:
    """The toy model of architecture ``arch`` (TOY_ARCHS), with ``fields`` set."""
    if arch not in TOY_ARCHS:
        raise ValueError(f"toy model arch {arch!r}: one of {', '.join(TOY_ARCHS)}")
    return ToyModelSpec(**{**TOY_ARCHS[arch], **fields})


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    arch = sys.argv[2] if len(sys.argv) > 2 else "qwen2"
    print(ensure_toy_model(toy_spec(arch), root=root))
