"""Tokenizers: a byte-level one for the built-in presets, `tokenizers` for checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from shared.model.chat_template import ChatTemplate


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int
    chat_template: ChatTemplate | None  # None: chat gets the built-in layout

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """256 byte tokens, then BOS (256) and EOS (257). encode adds no BOS."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json; special tokens (e.g. a BOS) are added as its post-processor
    says, unless add_special_tokens=False."""

    def __init__(self, path: Path, eos_token_id: int, chat_template: ChatTemplate | None = None) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.eos_token_id = eos_token_id
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(
    model_dir: Path | None, eos_token_id: int, with_chat_template: bool = False
) -> ByteTokenizer | HFTokenizer:
    """with_chat_template: also the checkpoint's chat template (only the router renders chats)."""
    if model_dir is not None and (model_dir / "tokenizer.json").exists():
        template = ChatTemplate.from_checkpoint(model_dir) if with_chat_template else None
        return HFTokenizer(model_dir / "tokenizer.json", eos_token_id, template)
    return ByteTokenizer()
