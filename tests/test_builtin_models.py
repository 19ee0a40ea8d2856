"""The built-in real model's GGUF conversion (launch/builtin_models.py), on a tiny GGUF written
here with the ``gguf`` package in the real file's layout: llama architecture, Q4_1 matrices, a
Q8_0 embedding tied to the head, F32 norms, q/k rows permuted for rotary as llama.cpp stores
them, a byte-level BPE tokenizer and a ChatML template. The real 135M file takes minutes; this
one converts in seconds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from launch import builtin_models
from launch.builtin_models import MARKER, MissingPackage, convert_gguf, ensure_builtin_model

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS = 2, 64, 128, 4, 2
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ t", "Ġt he", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def tokens():
    """Byte-level BPE vocabulary: the specials, the 256 byte symbols, then one token per merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute``: how q/k rows sit in a llama GGUF."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path) -> dict[str, np.ndarray]:
    """Write the tiny GGUF; returns, by Hugging Face name, the weights a correct conversion yields
    (the quantized values dequantized, q/k rows in Hugging Face order)."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    vocab = tokens()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny smollm2-like")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(3)  # MOSTLY_Q4_1, as the real file
    writer.add_vocab_size(len(vocab))
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(False)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))  # 3 = CONTROL
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHATML)
    writer.add_quantization_version(2)

    expected = {}

    def add(gguf_name, hf_name, w, qtype, permute_heads=None):
        stored = rope_permute(w, permute_heads) if permute_heads else w
        if qtype == Q.F32:
            writer.add_tensor(gguf_name, stored)
            expected[hf_name] = w
        else:
            writer.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)
            # quantization blocks lie along a row, so it commutes with the row permutation
            expected[hf_name] = dequantize(quantize(w, qtype), qtype)

    def matrix(rows, cols):
        return rng.standard_normal((rows, cols), dtype=np.float32) * 0.1

    def norm():
        return 1 + rng.standard_normal(HIDDEN, dtype=np.float32) * 0.1

    add("token_embd.weight", "model.embed_tokens.weight", matrix(len(vocab), HIDDEN), Q.Q8_0)
    for i in range(LAYERS):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        add(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", norm(), Q.F32)
        add(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", matrix(HIDDEN, HIDDEN), Q.Q4_1, HEADS)
        add(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", matrix(KV_HEADS * HEAD_DIM, HIDDEN),
            Q.Q4_1, KV_HEADS)
        add(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", matrix(KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_1)
        add(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", matrix(HIDDEN, HIDDEN), Q.Q4_1)
        add(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", norm(), Q.F32)
        add(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", matrix(FFN, HIDDEN), Q.Q4_1)
        add(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", matrix(FFN, HIDDEN), Q.Q4_1)
        add(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", matrix(HIDDEN, FFN), Q.Q4_1)
    add("output_norm.weight", "model.norm.weight", norm(), Q.F32)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny GGUF's path, the weights expected from it, its converted directory)."""
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny.Q4_1.gguf"
    expected = write_tiny_gguf(path)
    out = root / "converted"
    convert_gguf(path, out, log=lambda m: None)
    return path, expected, out


def test_weights_are_the_dequantized_values_in_bf16_with_tied_embeddings(tiny):
    import torch
    from safetensors.torch import load_file

    _, expected, out = tiny
    saved = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in saved or torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    saved.pop("lm_head.weight", None)
    assert sorted(saved) == sorted(expected)
    for name, want in expected.items():
        got = saved[name]
        assert got.dtype == torch.bfloat16, name
        # bf16 keeps 8 bits of mantissa: the dequantized float32 values rounded to bf16
        torch.testing.assert_close(got.float(), torch.from_numpy(want).to(torch.bfloat16).float(),
                                   rtol=2 ** -8, atol=1e-6, msg=name)


def test_converted_directory_reloads_offline_as_a_plain_model(tiny, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    _, expected, out = tiny
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == \
        (LAYERS, HEADS, KV_HEADS)
    assert (config["dtype"], config["vocab_size"], config["rope_parameters"]["rope_theta"]) == \
        ("bfloat16", len(tokens()), 100000.0)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    q = model.model.layers[1].self_attn.q_proj.weight
    want = torch.from_numpy(expected["model.layers.1.self_attn.q_proj.weight"]).to(q.dtype)
    torch.testing.assert_close(q.detach(), want, rtol=2 ** -8, atol=1e-6)
    logits = model(torch.tensor([[1, 40, 41, 2]])).logits
    assert logits.shape == (1, 4, len(tokens())) and torch.isfinite(logits).all()


def test_tokenizer_round_trips_and_carries_the_chat_template(tiny, monkeypatch):
    from transformers import AutoTokenizer

    _, _, out = tiny
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(out)
    vocab = tokens()
    assert len(tok) == len(vocab)
    text = "hello world, the end"
    ids = tok(text)["input_ids"]
    assert ids[:4] == [vocab.index(t) for t in ("hello", "Ġworld", ",", "Ġthe")]  # the merges apply
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok("<|im_start|>user")["input_ids"][0] == 1  # a special token stays whole


@pytest.fixture
def fake_package(tiny, tmp_path, monkeypatch):
    """An importable package shipping the tiny GGUF, registered as the built-in model ``tiny-gguf``."""
    package = tmp_path / "site" / "rlpipe_tiny_gguf_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tiny.gguf").write_bytes(tiny[0].read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(builtin_models.BUILTIN_MODELS, "tiny-gguf",
                        ("rlpipe_tiny_gguf_pkg", "tiny.gguf", "rlpipe-tiny-gguf-pkg==1.0"))
    return package


def test_ensure_builtin_model_builds_once_then_reuses_the_cache(fake_package, tmp_path, monkeypatch):
    calls = []

    def counting_convert(*args, **kwargs):
        calls.append(args)
        return convert_gguf(*args, **kwargs)

    monkeypatch.setattr(builtin_models, "convert_gguf", counting_convert)
    root = tmp_path / "models"
    first = ensure_builtin_model("tiny-gguf", root=root, log=lambda m: None)
    assert first == root / "tiny-gguf" and len(calls) == 1
    marker = json.loads((first / MARKER).read_text())
    assert marker["source"] == str(fake_package / "tiny.gguf")
    assert marker["requirement"] == "rlpipe-tiny-gguf-pkg==1.0"
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    assert not list(root.glob(".build-*"))
    assert ensure_builtin_model("tiny-gguf", root=root, log=lambda m: None) == first
    assert len(calls) == 1  # cached: not converted again


def test_a_missing_package_or_file_names_the_pip_requirement(fake_package, tmp_path, monkeypatch):
    monkeypatch.setitem(builtin_models.BUILTIN_MODELS, "absent",
                        ("rlpipe_no_such_package", "x.gguf", "rlpipe-no-such-package==9.9"))
    with pytest.raises(MissingPackage, match=r"absent needs the package rlpipe-no-such-package==9\.9"):
        ensure_builtin_model("absent", root=tmp_path / "models", log=lambda m: None)
    assert not (tmp_path / "models").exists()

    (fake_package / "tiny.gguf").unlink()
    with pytest.raises(MissingPackage, match=r"tiny\.gguf is missing from the installed rlpipe-tiny-gguf-pkg==1\.0"):
        ensure_builtin_model("tiny-gguf", root=tmp_path / "models", log=lambda m: None)
