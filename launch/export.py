"""``rlpipe export RUN_DIR OUT``: a run's checkpoint as a plain Hugging Face model directory.

A user's deliverable should load without rlpipe: with ``transformers``
(``AutoModelForCausalLM.from_pretrained(OUT)``) or served by vLLM (``vllm serve OUT``).
A learner checkpoint (``learner/checkpoint.py``) is close to that but not it:

- full fine-tune: the step directory is a Hugging Face directory plus rlpipe's own files
  (``trainer_state.pt``, ``meta.json``, ``rollout/`` quantized copies, ``optimizer/`` shards).
  Those are large (the Adam state is twice the weights), private to the learner, and
  ``trainer_state.pt`` is a pickle a user should not have to trust. The export copies only
  what a loader reads (an allow-list, so a file the learner adds later stays out too).
- LoRA: the step directory holds PEFT's ``save_pretrained`` output (``adapter_config.json``,
  ``adapter_model.safetensors``) and needs the base model and ``peft`` to load. The export
  merges the adapter into the base with peft itself (``merge_and_unload``: the library that
  defines the adapter's format and scaling, rather than a second, hand-written merge) in fp32,
  and saves the result in the base's own dtype, so it serves like the base did.

The export is written into a hidden sibling of OUT and renamed into place, so an
interrupted export never leaves a directory that looks complete. ``rlpipe_export.json`` in
OUT records where it came from: run, checkpoint, step and weights version.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from fnmatch import fnmatch
from pathlib import Path

from rlpipe.checkpoints import PREFIX, checkpoint_root, complete

# What a Hugging Face / vLLM loader reads from a model directory; nothing else is exported.
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "*.tiktoken", "spiece.model",
                   "chat_template.jinja", "chat_template.json", "additional_chat_templates/*")
PROVENANCE = "rlpipe_export.json"


class ExportError(Exception):
    """Bad input the user can fix (a missing checkpoint, an occupied OUT): exit 2."""


def _is_checkpoint(path: Path) -> bool:
    return (path / "meta.json").is_file() and any((path / f).is_file() for f in ("config.json", "adapter_config.json"))


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> tuple[Path, Path | None]:
    """The checkpoint to export and the run's ``config.yaml`` (None if there is none).

    ``run_dir`` is a run directory (its newest complete checkpoint, or ``step``'s) or one
    checkpoint directory itself (``.../checkpoints/step_00000010``). Only complete
    checkpoints count (``rlpipe.checkpoints.complete``): a half-written temporary never."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such directory (expected a run directory or a checkpoint)")
    if _is_checkpoint(run_dir):
        found = int(run_dir.name[len(PREFIX):]) if run_dir.name.startswith(PREFIX) else None
        if step is not None and found is not None and step != found:
            raise ExportError(f"{run_dir}: is the checkpoint of step {found}, not --step {step}")
        config = run_dir.parent.parent / "config.yaml"  # <run>/checkpoints/step_N
        return run_dir, config if config.is_file() else None
    config = run_dir / "config.yaml"
    root = run_dir / "checkpoints"
    if config.is_file():
        from rlpipe.config import ConfigError, load_config

        try:
            cfg = load_config(config)
        except ConfigError as e:
            raise ExportError(str(e)) from None
        if cfg.learner.checkpoint_dir:  # the run kept its checkpoints elsewhere
            root = checkpoint_root(cfg)
    found = complete(root)
    if not found:
        raise ExportError(f"{run_dir}: no complete checkpoint under {root} (a step_* directory with meta.json "
                          "and trainer_state.pt); has the learner saved one yet?")
    if step is None:
        return found[-1], config if config.is_file() else None
    chosen = [p for p in found if int(p.name[len(PREFIX):]) == step]
    if not chosen:
        steps = ", ".join(str(int(p.name[len(PREFIX):])) for p in found)
        raise ExportError(f"{root}: no complete checkpoint of step {step} (there are: {steps})")
    return chosen[0], config if config.is_file() else None


def _wanted(name: str, patterns: tuple[str, ...]) -> bool:
    """``name`` (relative, posix) matches a pattern at the same depth: ``*.safetensors`` is a
    top-level file, never ``rollout/int8/model.safetensors``."""
    return any(name.count("/") == p.count("/") and fnmatch(name, p) for p in patterns)


def copy_files(src: Path, out: Path, patterns: tuple[str, ...], skip_existing: bool = False) -> list[str]:
    """Copy the files of ``src`` (and their subfolders' files) matching ``patterns`` into
    ``out``; returns their relative names. The allow-list is why an export never carries
    ``trainer_state.pt``, ``optimizer/``, ``rollout/`` or ``meta.json``."""
    copied = []
    for f in sorted(src.rglob("*")):
        rel = f.relative_to(src).as_posix()
        if not f.is_file() or not _wanted(rel, patterns) or (skip_existing and (out / rel).exists()):
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, out / rel)
        copied.append(rel)
    return copied


def _check_weights(ckpt: Path) -> None:
    """A full fine-tune's checkpoint has its weights, every shard its index names included."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(s for s in shards if not (ckpt / s).is_file())
        if missing:
            raise ExportError(f"{ckpt}: weight shards named in model.safetensors.index.json are missing: {missing}")
    elif not (ckpt / "model.safetensors").is_file():
        raise ExportError(f"{ckpt}: no model.safetensors (nor adapter_config.json): not a checkpoint rlpipe can export")


def export_full(ckpt: Path, out: Path) -> dict:
    """A full fine-tune: the checkpoint already is the model; copy what a loader reads."""
    _check_weights(ckpt)
    copy_files(ckpt, out, MODEL_FILES + TOKENIZER_FILES)
    return {"kind": "full"}


def base_model_of(ckpt: Path, config: Path | None) -> Path:
    """The base model a LoRA checkpoint adapts, first found of: ``meta.json``'s
    ``base_model`` (what the learner trained on), the run's ``model.path`` (resolved as the
    run resolved it: a directory, a built-in or toy model from the cache), the adapter's own
    ``base_model_name_or_path``. Each must be a local Hugging Face directory: nothing is
    downloaded."""
    tried = []
    meta = json.loads((ckpt / "meta.json").read_text())
    candidates = [("meta.json base_model", lambda: meta.get("base_model"))]
    if config is not None:
        candidates.append((f"{config} model.path", lambda: _run_model(config)))
    adapter = json.loads((ckpt / "adapter_config.json").read_text())
    candidates.append(("adapter_config.json base_model_name_or_path", lambda: adapter.get("base_model_name_or_path")))
    for label, get in candidates:
        path = get()
        if path and (Path(path) / "config.json").is_file():
            return Path(path)
        tried.append(f"{label}={path!r}")
    raise ExportError(f"{ckpt}: LoRA checkpoint whose base model is not a local model directory "
                      f"(tried {'; '.join(tried)})")


def _run_model(config: Path) -> str | None:
    from launch.demo import resolve_model
    from rlpipe.config import ConfigError, load_config

    try:
        return resolve_model(load_config(config), log=lambda m: None)
    except (ConfigError, OSError, ValueError):
        return None


def export_lora(ckpt: Path, out: Path, base: Path) -> dict:
    """Merge the adapter into the base with peft (fp32, so the merge adds no rounding of its
    own) and save it in the base's dtype; the tokenizer comes from the checkpoint (as the
    run served it), anything it lacks from the base."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    base_cfg = AutoConfig.from_pretrained(base, local_files_only=True)
    dtype = getattr(base_cfg, "dtype", None) or getattr(base_cfg, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    model = PeftModel.from_pretrained(model, str(ckpt), is_trainable=False).merge_and_unload()
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    copy_files(ckpt, out, TOKENIZER_FILES)
    copy_files(base, out, TOKENIZER_FILES + ("generation_config.json",), skip_existing=True)
    return {"kind": "lora", "base_model": str(base.resolve()), "dtype": str(dtype).removeprefix("torch.")}


def _prepare_out(out: Path) -> Path:
    """OUT must be new or empty (an export never overwrites); the export is built in a
    hidden sibling, renamed to OUT when complete."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: already exists and is not an empty directory; choose a new OUT")
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Export ``run_dir``'s checkpoint (the newest, or ``step``'s) to ``out``; returns ``out``."""
    ckpt, config = find_checkpoint(run_dir, step)
    out = Path(out)
    lora = (ckpt / "adapter_config.json").is_file()
    base = base_model_of(ckpt, config) if lora else None
    tmp = _prepare_out(out)
    try:
        info = export_lora(ckpt, tmp, base) if lora else export_full(ckpt, tmp)
        meta = json.loads((ckpt / "meta.json").read_text())
        info = {"source": str(ckpt.resolve()), "run_dir": str(config.parent.resolve()) if config else None,
                "step": meta.get("step"), "version": meta.get("version"), **info,
                "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / PROVENANCE).write_text(json.dumps(info, indent=1) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
