"""The quantization profile artifact: what ``rlpipe calibrate`` writes once and every later
policy is quantized with (docs/design.md, 'Quantization').

A profile directory holds:

    profile.json          scheme, activations, alpha, static input scales, fingerprints,
                          tool versions, calibration and probe token ids, its own hash
    tensors.safetensors   ``smoothing.<norm>`` (hidden,) per smoothed norm and
                          ``weight_amax.<linear>`` (out,), the calibrated per-row range of
                          each smoothed weight (the saturation monitor's reference)
    checkpoint/           the base model as a compressed-tensors checkpoint for the engine

The hash covers every field and tensor (not the derived checkpoint): it is the
``quant_profile`` on every record and in every sync manifest. ``compat`` is what an
engine is *started for* (scheme, activations, base model): a recalibrated profile keeps
it, so its scales reach running engines through the sync without a restart, while a
profile of another scheme or model is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

SCHEME = "int8-w8a8"
FORMAT = 2  # 2: down_proj is smoothed through up_proj's rows


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the config field to fix."""


@dataclass
class QuantProfile:
    activations: str  # "static" (per-tensor scales from calibration) or "dynamic" (per-token)
    alpha: float
    smoothing: dict[str, torch.Tensor]  # norm (or up_proj) module -> (its output width,)
    input_scales: dict[str, float]  # linear module -> amax of its smoothed input / 127
    weight_amax: dict[str, torch.Tensor]  # linear module -> (out,) row amax of the smoothed base weights
    base_model: str  # fingerprint of the base model's weights and config
    calibration_set: str  # fingerprint of the calibration token ids
    calibration_ids: list[list[int]] = field(default_factory=list)
    probe_ids: list[list[int]] = field(default_factory=list)  # held out: the monitors' fixed probe set
    tools: dict[str, str] = field(default_factory=dict)
    parent: str = ""  # the profile this one re-calibrated ("" for the first)
    calibrated_on: str = "base"  # "base", or "version N" of the policy
    scheme: str = SCHEME
    format: int = FORMAT

    @property
    def static(self) -> bool:
        return self.activations == "static"

    @property
    def weight_max(self) -> float:
        from quant.int8 import WEIGHT_MAX

        return WEIGHT_MAX[self.scheme]

    def int8_tensors(self, params: dict[str, torch.Tensor], names=None):
        """Calibration transfer of ``params`` with this profile (quant/int8.py; ``names``:
        the whole model's parameter names when ``params`` is a part)."""
        from quant.int8 import int8_tensors

        return int8_tensors(params, self.smoothing, self.input_scales if self.static else None,
                            weight_max=self.weight_max, names=names)

    @property
    def compat(self) -> str:
        return compat_key(self.scheme, self.activations, self.base_model)

    def _meta(self) -> dict:
        tensor_fields = {"smoothing", "weight_amax"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in tensor_fields}

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {**{f"smoothing.{k}": v.float().contiguous() for k, v in self.smoothing.items()},
                **{f"weight_amax.{k}": v.float().contiguous() for k, v in self.weight_amax.items()}}

    @property
    def hash(self) -> str:
        h = hashlib.sha256(json.dumps(self._meta(), sort_keys=True).encode())
        for name, t in sorted(self._tensors().items()):
            h.update(name.encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()[:16]

    def save(self, directory: str | Path) -> Path:
        """Write ``profile.json`` and ``tensors.safetensors`` into ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self._tensors(), directory / "tensors.safetensors")
        (directory / "profile.json").write_text(json.dumps({**self._meta(), "hash": self.hash}, indent=1))
        return directory

    @classmethod
    def load(cls, directory: str | Path, field_name: str = "quant.int8.profile") -> "QuantProfile":
        from safetensors.torch import load_file

        directory = Path(directory)
        meta_path = directory / "profile.json"
        if not meta_path.is_file():
            raise ProfileError(f"{field_name}: {directory} holds no profile.json (run `rlpipe calibrate`)")
        try:
            meta = json.loads(meta_path.read_text())
            stored_hash = meta.pop("hash")
            tensors = load_file(directory / "tensors.safetensors")
            if meta.get("format") != FORMAT:
                raise ProfileError(f"{field_name}: {directory} has profile format {meta.get('format')}, "
                                   f"this rlpipe reads {FORMAT}")
            profile = cls(**meta,
                          smoothing={k.removeprefix("smoothing."): v for k, v in tensors.items() if k.startswith("smoothing.")},
                          weight_amax={k.removeprefix("weight_amax."): v for k, v in tensors.items()
                                       if k.startswith("weight_amax.")})
        except ProfileError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ProfileError(f"{field_name}: {directory} is not a readable profile: {e!r}") from None
        if profile.hash != stored_hash:
            raise ProfileError(f"{field_name}: {directory} is corrupt (content hash {profile.hash}, "
                               f"recorded {stored_hash})")
        return profile

    def check_model(self, model_dir: str | Path, field_name: str = "quant.int8.profile") -> None:
        """Refuse a profile calibrated for another base model."""
        fp = model_fingerprint(model_dir)
        if fp != self.base_model:
            raise ProfileError(f"{field_name}: the profile was calibrated for base model {self.base_model}, "
                               f"but model.path {model_dir} is {fp}")

    def summary(self) -> dict:
        return {"hash": self.hash, "scheme": self.scheme, "activations": self.activations, "alpha": self.alpha,
                "base_model": self.base_model, "calibration_set": self.calibration_set, "parent": self.parent,
                "calibrated_on": self.calibrated_on, "tools": self.tools}


def load_for_run(int8, model_path: str | Path) -> QuantProfile:
    """The run's int8 profile (``quant.int8.profile``; ``int8`` is that section), checked
    against the run: it exists, was calibrated for ``model_path`` and for
    ``quant.int8.activations``. Workers and the learner make the same checks, so a bad
    profile is refused at start-up by every role."""
    if not int8.profile:
        raise ProfileError("quant.int8.profile: int8 rollout needs a calibration profile (`rlpipe calibrate`; "
                           "`rlpipe demo` calibrates one itself)")
    profile = QuantProfile.load(int8.profile)
    profile.check_model(model_path)
    if profile.activations != int8.activations:
        raise ProfileError(f"quant.int8.activations: {int8.activations!r}, but profile {profile.hash} was "
                           f"calibrated for {profile.activations!r} activations")
    return profile


def compat_key(scheme: str, activations: str, base_model: str) -> str:
    return f"{scheme}/{activations}/{base_model}"


def fp8_identity(base_model: str) -> tuple[str, str]:
    """Learner-side fp8's ``(compat, quant_profile hash)`` for the base model's fingerprint.
    The engine is started for the one (quant/precision_profile.py) and every manifest of the wire
    carries the other (quant/transfer.py ``Fp8Weights``): computed here only, since a worker
    refuses every update whose pair differs from its engine's."""
    compat = compat_key("fp8-w8a8", "dynamic", base_model)
    return compat, hashlib.sha256(compat.encode()).hexdigest()[:16]


def model_fingerprint(model_dir: str | Path) -> str:
    """Hash of a model directory's config and weight files (contents, streamed)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ProfileError(f"model.path: {model_dir} holds no safetensors weights")
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    for key in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"):
        h.update(f"{key}={config.get(key)}".encode())
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:16]


def token_fingerprint(sequences: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(sequences).encode()).hexdigest()[:16]


def write_checkpoint(tensors: dict[str, torch.Tensor], base_dir: str | Path, out_dir: str | Path,
                     quantization_config: dict) -> Path:
    """A model directory vLLM loads: ``tensors`` as safetensors, the base model's config
    with ``quantization_config`` and ``torch_dtype`` bfloat16, and its tokenizer files.
    Written to a temporary sibling and renamed into place."""
    from safetensors.torch import save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=out_dir.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors",
                  metadata={"format": "pt"})
        config = json.loads((base_dir / "config.json").read_text())
        config["quantization_config"] = quantization_config
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        for f in base_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json",) \
                    and not f.name.endswith((".bin", ".pt", ".index.json")):
                shutil.copy2(f, tmp / f.name)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
