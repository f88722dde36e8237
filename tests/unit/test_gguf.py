"""GGUF checkpoints: a small random model written with gguf's own writer, as llama.cpp lays it
out (q/k rows interleaved per head in llama-architecture files), against the same weights as a
safetensors directory: identical logits, for every weight type; and against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from shared.config import ModelSettings
from shared.model import load_model
from shared.model.describe import describe_model

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64  # K-quants: rows of 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def _llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotate-half rows interleaved."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    """Every byte's symbol, a few merges, and the special tokens after them."""
    symbols = list(pre_tokenizers.ByteLevel.alphabet())
    symbols.sort(key=lambda s: (len(s.encode()), s))
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n"]
    tokens = symbols + [m.replace(" ", "") for m in merges] + SPECIALS
    return tokens, merges


def _hf_tokenizer(tokens: list[str], merges: list[str]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens) if t not in SPECIALS}
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert [tok.token_to_id(s) for s in SPECIALS] == [tokens.index(s) for s in SPECIALS]
    return tok


def _weights(arch: str, vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,)}
    shapes["lm_head.weight"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (q, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        }
        if arch == "qwen2":
            shapes |= {p + f"self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))}
        if arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,)}
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith("bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return out


def _random_k_quant(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with small finite scales (gguf has no K-quant quantizer): any bits are a
    valid block once its fp16 scales are."""
    size, bytes_per = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // size, bytes_per), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)
    if kind == Q.Q6_K:  # ..., d at the end
        raw[..., -2:] = scale
    else:  # d, dmin first
        raw[..., 0:2], raw[..., 2:4] = scale, np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def _encode(w: np.ndarray, kind: Q, rng: np.random.Generator) -> np.ndarray:
    if kind == Q.F32:
        return w
    if kind == Q.F16:
        return w.astype(np.float16)
    if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return _random_k_quant(kind, *w.shape, rng)
    return gguf.quantize(w, kind)


def write_pair(
    tmp: Path, arch: str, kind: Q, *, tied: bool = False, seed: int = 0, extra_hf: dict | None = None
) -> tuple[Path, Path]:
    """The same model twice: FILE.gguf (matrices in `kind`) and a safetensors directory holding
    what those encode, dequantized (exactly representable in float32)."""
    tokens, merges = _byte_level_vocab()
    weights = _weights(arch, len(tokens), seed)
    if tied:
        del weights["lm_head.weight"]
    rng = np.random.default_rng(seed + 1)
    path = tmp / f"{arch}-{kind.name}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    reference = {}
    for name, value in weights.items():
        encoded = value if value.ndim == 1 else _encode(value, kind, rng)  # norms and biases stay F32
        dequantized = gguf.dequantize(encoded, kind if value.ndim > 1 else Q.F32).reshape(value.shape)
        reference[name] = np.ascontiguousarray(dequantized, dtype=np.float32)
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):  # rows (and their bytes) move
            encoded = _llama_cpp_permute(encoded, HEADS if "q_proj" in name else KV_HEADS)
        w.add_tensor(_gguf_name(name), encoded, raw_dtype=None if encoded.dtype.kind == "f" else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    hf_dir = tmp / f"{arch}-{kind.name}-hf"
    hf_dir.mkdir()
    save_file(reference, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "model_type": arch,
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
        ],
        "vocab_size": len(tokens),
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": tokens.index("<|im_start|>"),
        "eos_token_id": tokens.index("<|im_end|>"),
        "torch_dtype": "float32",
        **(extra_hf or {}),
    }
    (hf_dir / "config.json").write_text(json.dumps(config))
    _hf_tokenizer(tokens, merges).save(str(hf_dir / "tokenizer.json"))
    return path, hf_dir


IDS = [5, 80, 257, 263, 100, 33, 70, 200, 12, 9, 261, 140, 44, 2, 90, 91, 17, 250, 3, 64]


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_gguf_weights_give_the_logits_of_the_same_weights_in_safetensors(tmp_path, kind):
    gguf_file, hf_dir = write_pair(tmp_path, "llama", kind, seed=int(kind))
    ours, config, tok = load_model(ModelSettings(path=str(gguf_file)))
    ref, ref_config, ref_tok = load_model(ModelSettings(path=str(hf_dir)))
    assert torch.equal(ours.dense_logits(IDS), ref.dense_logits(IDS))
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config.eos_token_ids == ref_config.eos_token_ids and not config.tie_word_embeddings
    assert config.model_id.startswith(f"llama-{kind.name}-")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_families_and_tied_embeddings(tmp_path, arch):
    gguf_file, hf_dir = write_pair(tmp_path, arch, Q.Q8_0, tied=True)
    ours, config, _ = load_model(ModelSettings(path=str(gguf_file)))
    ref, _, _ = load_model(ModelSettings(path=str(hf_dir)))
    assert (
        config.tie_word_embeddings
        and config.qkv_bias == (arch == "qwen2")
        and config.qk_norm == (arch == "qwen3")
    )
    assert torch.equal(ours.dense_logits(IDS), ref.dense_logits(IDS))


def test_gguf_matches_transformers(tmp_path):
    """The llama-architecture file (rows permuted as llama.cpp writes them) against transformers
    running the same weights from safetensors."""
    transformers = pytest.importorskip("transformers")
    gguf_file, hf_dir = write_pair(tmp_path, "llama", Q.F32)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    ours, _, _ = load_model(ModelSettings(path=str(gguf_file)))
    assert (ours.dense_logits(IDS) - expected).abs().max().item() <= 1e-4


def test_gguf_tokenizer_and_chat_template_come_from_its_metadata(tmp_path):
    gguf_file, hf_dir = write_pair(tmp_path, "llama", Q.F32)
    info, ref = (
        describe_model(ModelSettings(path=str(gguf_file))),
        describe_model(ModelSettings(path=str(hf_dir))),
    )
    for text in ["the theater in an era", " héllo\n\n\twörld 123 ✓", "<|im_start|>user\nhi<|im_end|>", ""]:
        assert info.tokenizer.encode(text) == ref.tokenizer.encode(text), text
        assert info.tokenizer.decode(info.tokenizer.encode(text)) == ref.tokenizer.decode(
            ref.tokenizer.encode(text)
        )
    prompt = info.tokenizer.chat_template.render(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n"
    assert info.served_name == str(gguf_file) and info.model_id.startswith("llama-F32-")


def test_dtype_is_the_serving_dtype(tmp_path):
    gguf_file, _ = write_pair(tmp_path, "llama", Q.Q8_0)
    model, _, _ = load_model(ModelSettings(path=str(gguf_file), dtype="bfloat16"))
    assert model.lm_head.weight.dtype == torch.bfloat16
    auto, _, _ = load_model(ModelSettings(path=str(gguf_file)))
    assert auto.lm_head.weight.dtype == torch.float32  # auto on the CPU


def test_unsupported_gguf_is_refused(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported"):
        load_model(ModelSettings(path=str(path)))
