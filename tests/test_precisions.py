"""Each precision defined once (rlpipe/precisions.py): the config, the wire schema, the
engine profile and the learner's wire all read the one table; learner-side fp8's compat
key and hash come from one function on both sides; the three wires share one protocol."""

from __future__ import annotations

import typing

import pytest
import torch

from quant.precision_profile import profile_for
from quant.quant_profile import fp8_identity, model_fingerprint
from quant.transfer import CastWeights, Fp8Weights, Int8Weights, Wire, rollout_weights
from rlpipe import schema
from rlpipe.config import IS_MODES, IsMode, Precision, build_config
from rlpipe.precisions import PRECISIONS, SPECS


def test_every_list_of_precisions_and_is_modes_is_the_one_definition():
    assert schema.PRECISIONS is PRECISIONS == tuple(SPECS) == typing.get_args(Precision)
    from learner.loss import IS_MODES as loss_modes

    assert loss_modes is IS_MODES == typing.get_args(IsMode)


def test_fp8_learner_side_compat_is_one_functions_output_on_both_sides(toy_model_path):
    """The engine is started for what profile_for says, and the learner's manifests carry what
    Fp8Weights says: if they differed, every worker would refuse every update. Pinned byte
    for byte, so cached checkpoints and running workers keep matching."""
    assert fp8_identity("abc") == ("fp8-w8a8/dynamic/abc", "dbf810e14165ba25")
    cfg = build_config({}, environ={}, **{"model.path": toy_model_path, "rollout.precision": "fp8",
                                          "quant.fp8.quantize_on": "learner"})
    engine = profile_for("fp8", cuda=False, quant=cfg.quant, model_path=toy_model_path)
    wire = rollout_weights("fp8", cfg.quant, toy_model_path)
    expected = fp8_identity(model_fingerprint(toy_model_path))
    assert (engine.compat, engine.profile_hash) == (wire.compat, wire.quant_profile) == expected
    assert engine.quant_hash == wire.quant_profile and engine.checkpoint


@pytest.mark.parametrize("precision, dtype, cpu, cuda", [
    ("fp32", torch.float32, None, None), ("bf16", torch.bfloat16, None, None), ("fp16", torch.float16, None, None),
    ("fp8", torch.bfloat16, "fp8_per_channel", "fp8"),  # quant.fp8.quantize_on: worker, the default
])
def test_a_cast_precision_s_engine_and_wire_come_from_its_row(precision, dtype, cpu, cuda):
    quant = build_config({}, environ={}).quant
    assert quant.wire(precision) == "cast"
    wire = rollout_weights(precision, quant, "")
    assert isinstance(wire, CastWeights) and wire.cast_to == dtype and not wire.quantized
    assert (wire.quant_profile, wire.compat, wire.status()) == ("", "", None)
    for on_cuda, quantization in ((False, cpu), (True, cuda)):
        engine = profile_for(precision, cuda=on_cuda, quant=quant)
        assert (engine.precision, engine.dtype, engine.quantization) == (precision, str(dtype)[6:], quantization)
        assert engine.checkpoint == engine.compat == ""
    with pytest.raises(ValueError, match="rollout.precision: unknown value 'fp4'"):
        profile_for("fp4")


def test_the_three_wires_are_one_protocol():
    assert all(Wire in w.__mro__ for w in (CastWeights, Fp8Weights, Int8Weights))  # each declares it
    assert (CastWeights.quantized, Fp8Weights.quantized, Int8Weights.quantized) == (False, True, True)
    assert Fp8Weights.cast_to is None and Int8Weights.cast_to is None
    fp8 = Fp8Weights("abc")
    assert fp8.status() is None and (fp8.compat, fp8.quant_profile) == fp8_identity("abc")


def test_a_fleet_s_precisions_channels_and_wires():
    cfg = build_config({}, environ={}, **{"rollout.fleet": ["int8", "fp8", "int8", "bf16"],
                                          "quant.fp8.quantize_on": "learner", "workers": 4})
    r = cfg.rollout
    assert r.precisions == ["int8", "fp8", "bf16"]
    assert [r.worker_precision(i) for i in range(5)] == ["int8", "fp8", "int8", "bf16", "int8"]
    assert [r.channel(p) for p in r.precisions] == ["int8", "fp8", "bf16"]
    assert [cfg.quant.wire(p) for p in r.precisions] == ["int8", "fp8", "cast"]
    alone = build_config({}, environ={}, **{"rollout.precision": "fp8"})
    assert alone.rollout.precisions == ["fp8"] and alone.rollout.channel("fp8") == ""
    assert alone.rollout.worker_precision(3) == "fp8" and alone.quant.wire("fp8") == "cast"
