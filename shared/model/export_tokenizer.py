"""The presets' byte tokenizer as Hugging Face tokenizer files, so another server (vLLM,
transformers) given a save_hf directory tokenizes and detokenizes exactly as pdd does.

A byte-level BPE without merges: ids 0..255 are the UTF-8 bytes (spelled with GPT-2's
printable byte alphabet, which the ByteLevel pre-tokenizer and decoder translate), then BOS
and EOS as special tokens. No post-processor: encode adds nothing, as ByteTokenizer. The chat
template writes the router's built-in chat layout (openai_request.chat_prompt).
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.model.tokenizer import ByteTokenizer

BOS_TOKEN, EOS_TOKEN = "<|bos|>", "<|eos|>"
# The router's layout for a model without a template: "<|role|>\ncontent\n" per message, then
# "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: each byte as one printable character (the ByteLevel mapping)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_hf():
    """A `tokenizers.Tokenizer` with ByteTokenizer's ids and special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(BOS_TOKEN, special=True, normalized=False),
            AddedToken(EOS_TOKEN, special=True, normalized=False),
        ]
    )
    assert tok.token_to_id(BOS_TOKEN) == ByteTokenizer.bos_token_id
    assert tok.token_to_id(EOS_TOKEN) == ByteTokenizer.eos_token_id
    return tok


def save_byte_tokenizer(out_dir: str | Path, model_max_length: int) -> Path:
    """Write tokenizer.json, tokenizer_config.json (with the chat template), special_tokens_map.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    byte_tokenizer_hf().save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # decode must give back the bytes, spaces and all
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return out
