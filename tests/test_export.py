"""``rlpipe export`` (launch/export.py): a run's checkpoint as a Hugging Face directory that
loads without rlpipe.

A full fine-tune's export is the checkpoint's model files and nothing of rlpipe's; a LoRA
checkpoint's is the adapter merged into its base by peft. The deliverable's test is the
one a user would make: vLLM serving the export answers (greedy) as the run's own engine
did, the base with the adapter applied by vLLM's LoRA layers.

    python -m tests.test_export MODEL PROMPTS_JSON [ADAPTER]

is the vLLM half: one in-process fp32 engine in its own process (an in-process engine pins
its caller's threads), greedy answers to each prompt as JSON, with and without the adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.cli import main as cli_main
from launch.toy import encode, ensure_toy_model, toy_spec
from tests.conftest import ROOT

PROMPTS = ["12+7=", "3*4=", "9-5=", "7+8="]
EXTRAS = ("trainer_state.pt", "meta.json", "rollout", "optimizer", "adapter_config.json", "adapter_model.safetensors")


def _checkpoint(run: Path, step: int, model_dir: Path | None, meta: dict) -> Path:
    """A learner checkpoint as learner/checkpoint.py lays it out: the model's files (when
    ``model_dir``), trainer_state.pt, meta.json, a rollout copy and optimizer shards."""
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    if model_dir is not None:
        shutil.copytree(model_dir, ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.save({"optimizer": {}}, ckpt / "trainer_state.pt")
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "version": step + 1, **meta}))
    (ckpt / "rollout" / "int8").mkdir(parents=True)
    (ckpt / "rollout" / "int8" / "model.safetensors").write_bytes(b"not a model")
    (ckpt / "optimizer").mkdir()
    (ckpt / "optimizer" / ".metadata").write_bytes(b"shards")
    return ckpt


def _logits(path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def _export(run, out, *extra) -> int:
    return cli_main(["export", str(run), str(out), *extra])


def test_full_finetune_exports_the_model_files_only(tmp_path, toy_model_path):
    """The export of a full fine-tune loads with transformers alone and gives the
    checkpoint's own logits; none of rlpipe's files come along."""
    run = tmp_path / "run"
    _checkpoint(run, 2, Path(toy_model_path), {})
    ckpt = _checkpoint(run, 4, Path(toy_model_path), {})
    assert _export(run, tmp_path / "out") == 0
    out = tmp_path / "out"
    names = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert {"config.json", "model.safetensors", "tokenizer.json", "rlpipe_export.json"} <= names
    assert not names & set(EXTRAS) and "rlpipe_toy.json" not in names
    info = json.loads((out / "rlpipe_export.json").read_text())
    assert (info["kind"], info["step"], info["version"], info["source"]) == ("full", 4, 5, str(ckpt.resolve()))
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(out).encode("12+7=")
    assert torch.equal(_logits(out, tokens), _logits(ckpt, tokens))
    # --step picks an older one; a checkpoint directory is a RUN_DIR too
    assert _export(run, tmp_path / "old", "--step", "2") == 0
    assert json.loads((tmp_path / "old" / "rlpipe_export.json").read_text())["step"] == 2
    assert _export(ckpt, tmp_path / "direct") == 0


def _lora_run(tmp_path: Path, base: Path, meta_base: bool = True) -> tuple[Path, Path]:
    """A LoRA run's checkpoint: PEFT's save_pretrained output of a random rank-8 adapter on
    every linear layer (B random: peft starts it at zero, which changes nothing), the
    tokenizer, trainer_state.pt and meta.json naming the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = tmp_path / "lora-run"
    ckpt = _checkpoint(run, 6, None, {"base_model": str(base)} if meta_base else {})
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(base / f, ckpt / f)
    return run, ckpt


@pytest.fixture(scope="module")
def llama_toy() -> Path:
    return ensure_toy_model(toy_spec("llama"), log=lambda m: None)


def test_lora_export_is_the_merged_model(tmp_path, llama_toy):
    """peft's merge equals the adapter applied (logits to fp32 rounding), differs from the
    base (so the check can fail), carries no adapter files, and keeps the base's dtype."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, ckpt = _lora_run(tmp_path, llama_toy)
    out = tmp_path / "merged"
    assert _export(run, out) == 0
    assert not {p.name for p in out.iterdir()} & set(EXTRAS)
    info = json.loads((out / "rlpipe_export.json").read_text())
    assert (info["kind"], info["step"], info["dtype"]) == ("lora", 6, "float32")
    tokens = [1, *range(4, 19)]
    base = AutoModelForCausalLM.from_pretrained(llama_toy, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, str(ckpt))(torch.tensor([tokens])).logits[0]
    merged = _logits(out, tokens)
    assert torch.allclose(merged, adapted, atol=1e-4), (merged - adapted).abs().max()
    assert (merged - _logits(llama_toy, tokens)).abs().max() > 0.1

    # a bf16 base: merged in fp32, saved in bf16; the base found through the adapter's own config
    bf16 = tmp_path / "base-bf16"
    AutoModelForCausalLM.from_pretrained(llama_toy, dtype=torch.bfloat16).save_pretrained(bf16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(llama_toy / f, bf16 / f)
    run16, ckpt16 = _lora_run(tmp_path / "b", bf16, meta_base=False)
    assert _export(ckpt16, tmp_path / "merged16") == 0
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "merged16" / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "merged16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_errors_name_what_is_wrong(tmp_path, toy_model_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    assert _export(run, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert str(run) in err and "no complete checkpoint" in err
    _checkpoint(run, 1, Path(toy_model_path), {})
    assert _export(run, tmp_path / "out", "--step", "7") == 2
    assert "step 7" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    assert _export(run, tmp_path / "busy") == 2
    assert str(tmp_path / "busy") in capsys.readouterr().err
    assert _export(tmp_path / "nowhere", tmp_path / "out") == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _greedy(model: Path, prompts: list[list[int]], adapter: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "tests.test_export", str(model), json.dumps(prompts)]
    args += [str(adapter)] if adapter else []
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


# soak: two engines (about a minute), over the suite's budget; in the suite the export's logits equal peft's
# with the adapter applied (above), and tests/test_lora_engine.py has vLLM's adapter equal the learner's
@pytest.mark.slow
@pytest.mark.soak
def test_lora_export_serves_the_answers_of_the_adapter_in_vllm(tmp_path, llama_toy):
    """vLLM on the export answers as vLLM on the base with the adapter (LoRARequest): the
    last version the run served. fp32 engines, so bf16 rounding cannot flip an argmax."""
    run, ckpt = _lora_run(tmp_path, llama_toy)
    out = tmp_path / "merged"
    assert _export(run, out) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    prompts = [encode(tok, p) for p in PROMPTS]
    served = _greedy(llama_toy, prompts, adapter=ckpt)
    exported = _greedy(out, prompts)
    print(json.dumps({"served": served, "exported": exported}))
    assert exported["plain"] == served["adapter"]
    assert served["plain"] != served["adapter"]  # the adapter changes the answers: the check can fail


def _engine_main(model: str, prompts_json: str, adapter: str | None = None) -> None:
    for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1} if adapter else {}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=64, seed=0, gpu_memory_utilization=0.5,
              distributed_executor_backend="uni", disable_log_stats=True, **lora)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts_json)]
    out = {}
    for name, req in [("plain", None)] + ([("adapter", LoRARequest("export", 1, adapter))] if adapter else []):
        out[name] = [list(r.outputs[0].token_ids) for r in llm.generate(requests, params, lora_request=req,
                                                                        use_tqdm=False)]
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    _engine_main(*sys.argv[1:])
