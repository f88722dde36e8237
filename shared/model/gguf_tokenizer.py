"""The tokenizer a GGUF file describes, built with `tokenizers` from its metadata: the
vocabulary, the merges, the token types (control tokens are special), BOS/EOS, the
pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`, and the chat template.

A byte-level BPE (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen2/3, SmolLM, ...) is rebuilt
with the pre-tokenizer its own tokenizer.json has: the split expressions are the ones
llama.cpp keeps for each named pre-tokenizer. A sentencepiece vocabulary ("llama": Llama 2,
Mistral) becomes a byte-fallback BPE with merges ranked by the vocabulary's scores, as
transformers converts it. A pre-tokenizer or a tokenizer model not listed here is refused:
encoding text differently from the model's own tokenizer would be a silent wrong answer.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from shared.model.chat_template import ChatTemplate

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (splits in order, NFC first?, ignore_merges): as each model's tokenizer.json.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": ((_GPT2_SPLIT,), False, False),
    "gpt2": ((_GPT2_SPLIT,), False, False),
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False, False),  # digits one by one, then GPT-2's
    "llama-bpe": ((_LLAMA3_SPLIT,), False, True),
    "llama3": ((_LLAMA3_SPLIT,), False, True),
    "smaug-bpe": ((_LLAMA3_SPLIT,), False, True),
    "qwen2": ((_QWEN2_SPLIT,), True, False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), True, False),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def _bpe_tokenizer(meta: dict[str, Any], where: str) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{where}: tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    splits, nfc, ignore_merges = PRE_TOKENIZERS[pre]
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError(f"{where}: a BPE tokenizer without tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_tokenizer(meta: dict[str, Any], where: str) -> Tokenizer:
    tokens, scores = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError(f"{where}: a sentencepiece tokenizer without tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    # Merges recovered from the vocabulary as transformers converts sentencepiece: every split
    # of a token into two tokens, best score first, then shorter left and right halves.
    found = []
    for token, score in zip(tokens, scores, strict=True):
        pieces = [(token[:k], token[k:]) for k in range(1, len(token))]
        pieces = sorted(
            (p for p in pieces if p[0] in vocab and p[1] in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]])
        )
        found += [(left, right, score) for left, right in pieces]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    ranked = [(left, right) for left, right, _ in found]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab,
        ranked,
        unk_token=None if unk is None else tokens[unk],
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return tok


def tokenizer_from_gguf(meta: dict[str, Any], where: str) -> Tokenizer:
    """`meta`: the file's tokenizer.* fields (see GGUFCheckpoint.tokenizer_metadata)."""
    kind = meta.get("tokenizer.ggml.model")
    if not meta.get("tokenizer.ggml.tokens"):
        raise ValueError(f"{where}: no tokenizer (tokenizer.ggml.tokens is missing); it cannot be served")
    if kind == "gpt2":
        tok = _bpe_tokenizer(meta, where)
    elif kind == "llama":
        tok = _spm_tokenizer(meta, where)
    else:
        raise ValueError(f"{where}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    )
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == USER_DEFINED
        ]
    )
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    single, special = "$A", []
    if add_bos and bos is not None:
        single, special = f"{tokens[bos]} {single}", [(tokens[bos], bos)]
    if add_eos and eos is not None:
        single, special = f"{single} {tokens[eos]}", [*special, (tokens[eos], eos)]
    if special:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    return tok


def chat_template_from_gguf(meta: dict[str, Any], where: str) -> ChatTemplate | None:
    """tokenizer.chat_template (and named ones, tokenizer.chat_template.<name>), with the special
    tokens a template sees (bos_token, eos_token, ...)."""
    templates = {"default": meta["tokenizer.chat_template"]} if "tokenizer.chat_template" in meta else {}
    prefix = "tokenizer.chat_template."
    templates.update({k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)})
    if not templates:
        return None
    tokens = meta["tokenizer.ggml.tokens"]
    special = {
        f"{name}_token": tokens[i]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None and 0 <= i < len(tokens)
    }
    try:
        return ChatTemplate(templates, special)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
