"""Decode speed of the rollout engine on SmolLM2-135M-Instruct, by precision and with a LoRA
adapter (issue 35: "an int8 base that is also fast"): response tokens/s of one engine on one
core (``OMP_NUM_THREADS=1``, pinned), at batch sizes from one request to a full step's worth,
every response exactly ``--tokens`` long (``ignore_eos``), after a warm-up batch of the same
shape. Each engine runs in a fresh process (vLLM keeps global state per process) with the
arguments a worker gives it (``RolloutEngine.engine_kwargs``) and the worker's start-up
(``rlpipe_init``: the CPU LoRA kernels, the int8 fixes).

- ``int8``: the recipe's profile (calibrated once, cached like the demo's), W8A8 with dynamic
  per-token activations; its activations, head and attention are bf16, as vLLM's CPU int8
  path requires.
- ``+lora``: a rank-8 adapter on every linear of the decoder (random, as the speed does not
  depend on its values), loaded as the worker loads a version.

Where the time goes inside an engine is a profiler's question: ``py-spy record -p PID`` on the
engine process while it decodes (docs/quantization.md has what it showed here). The CPU's
flags decide the kernels (AVX2 only, AVX512-VNNI, AMX, native bf16), so the report names them.

    python -P bench/decode_speed.py                          # fp32, bf16, int8, each with and without LoRA
                                                             # (bf16 takes over 10 minutes on a CPU without
                                                             # native bf16: every linear in torch's fallback)
    python -P bench/decode_speed.py --engines int8,int8+lora --batches 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "configs" / "smollm2-math.yaml"
QUESTION = ("Sam had 70 seashells. He gave some to Joan and has 27 left. How many did he give to Joan? "
            "Give the final answer as a number at the end.")


def cpu_flags() -> str:
    """The flags that choose vLLM's CPU kernels, as ``lscpu`` names them."""
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni")
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return " ".join(f for f in wanted if f in have) or "none of " + ", ".join(wanted)
    return "unknown"


def engine_speed(spec: dict) -> dict[str, float]:
    """In its own process: one engine decodes ``spec['tokens']`` tokens for each batch size."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from quant.precision_profile import profile_for
    from rlpipe.config import Int8Quant, QuantConfig, RolloutConfig
    from rollout_service.adapters import LoraServe
    from rollout_service.engine import RolloutEngine

    quant = QuantConfig(int8=Int8Quant(profile=spec["profile"], activations="dynamic"))
    profile = profile_for(spec["precision"], quant=quant, model_path=spec["model"])
    lora = LoraServe(8, 1, 1) if spec["adapter"] else None
    engine = RolloutEngine(spec["model"], profile, RolloutConfig(max_model_len=512, kv_cache_gib=2,
                                                                     engine=spec.get("engine_args", {})), lora=lora)
    llm = LLM(**engine.engine_kwargs())
    llm.collective_rpc("rlpipe_init", args=(engine.model_dir, profile.compat, engine.quant_profile,
                                            lora.rank if lora else 0))
    request = None
    if lora:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("rlpipe-v0", 1, spec["adapter"])
    prompt = TokensPrompt(prompt_token_ids=spec["prompt"])
    params = SamplingParams(temperature=0.5, max_tokens=spec["tokens"], ignore_eos=True, seed=0)
    out = {}
    for batch in spec["batches"]:
        llm.generate([prompt] * batch, params, use_tqdm=False, lora_request=request)  # warm-up, same shape
        t0 = time.perf_counter()
        llm.generate([prompt] * batch, params, use_tqdm=False, lora_request=request)
        out[str(batch)] = batch * spec["tokens"] / (time.perf_counter() - t0)
        print(f"  {spec['name']} batch {batch}: {out[str(batch)]:.1f} tokens/s", file=sys.stderr, flush=True)
    return out


def random_adapter(model_dir: str, out: Path) -> Path:
    """A rank-8 peft adapter on every linear of the decoder (peft's "all-linear" leaves the head
    out, as ``learner.lora`` does), B not zero."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))  # learner.lora's default
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    model.save_pretrained(out)
    return out


def report(rows: dict[str, dict[str, float]], batches: list[int], tokens: int):
    from launch.results import Section

    sec = Section("decode-speed", "Rollout decode speed on SmolLM2-135M by precision, with and without a LoRA "
                  "adapter (one core)")
    top = str(batches[-1])
    base = {k: rows[k][top] for k in ("bf16", "fp32") if k in rows}
    sec.table(f"Response tokens/s, {tokens} tokens a response, one engine on one core",
              ["engine", *[f"batch {b}" for b in batches], *[f"vs {k} at batch {top}" for k in base]],
              [[name, *[r[str(b)] for b in batches], *[r[top] / v for v in base.values()]] for name, r in rows.items()])
    sec.note(f"CPU flags that choose vLLM's kernels here: {cpu_flags()}.")
    sec.data = {"rows": rows, "batches": batches, "tokens": tokens, "cpu_flags": cpu_flags()}
    return sec


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="fp32,fp32+lora,bf16,bf16+lora,int8,int8+lora")
    ap.add_argument("--batches", default="1,16,64", help="requests decoded at once")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each response decodes")
    ap.add_argument("--json", help="write the report section here (launch/results.py)")
    ap.add_argument("--engine-args", default="{}", help="more vLLM engine arguments for every engine, as JSON "
                    "(rollout.engine's), e.g. '{\"hf_overrides\": {\"head_dtype\": \"float32\"}}'")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: one engine process
    args = ap.parse_args(argv)
    if args.engine:
        Path(args.engine + ".out").write_text(json.dumps(engine_speed(json.loads(Path(args.engine).read_text()))))
        return {}
    from transformers import AutoTokenizer

    from bench.real_quant import run_engine
    from launch.demo import resolve_model, resolve_quant_profile
    from rlpipe.config import load_config

    cfg = load_config(RECIPE, environ={}, **{"rollout.precision": "int8"})
    model = resolve_model(cfg, log=lambda m: print(m, file=sys.stderr))
    engines = args.engines.split(",")
    profile = resolve_quant_profile(cfg, model, progress=False, log=lambda m: print(m, file=sys.stderr)) \
        if any(e.startswith("int8") for e in engines) else ""
    batches = [int(b) for b in args.batches.split(",")]
    prompt = AutoTokenizer.from_pretrained(model).apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        adapter = random_adapter(model, workdir / "adapter") if any("+lora" in e for e in engines) else None
        for name in engines:
            precision, _, extra = name.partition("+")
            spec = {"name": name, "precision": precision, "model": model, "profile": profile, "prompt": list(prompt),
                    "tokens": args.tokens, "batches": batches, "adapter": str(adapter) if extra == "lora" else "",
                    "workdir": str(workdir), "engine_args": json.loads(args.engine_args)}
            rows[name] = run_engine(spec, __file__, name.replace("+", "-"))
            print(f"[decode-speed] {name}: " + ", ".join(f"batch {b} {v:.1f}" for b, v in rows[name].items())
                  + " tokens/s", file=sys.stderr, flush=True)
    sec = report(rows, batches, args.tokens)
    for t in sec.tables:
        print(json.dumps(t, default=float))
    if args.json:
        print(f"[decode-speed] wrote {sec.write(args.json)}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
