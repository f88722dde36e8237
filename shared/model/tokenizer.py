"""Tokenizers: a byte-level one for the built-in presets, `tokenizers` for checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as _Tok

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
    """A `tokenizers` tokenizer: a checkpoint's tokenizer.json, or one built from a GGUF file's
    metadata. Special tokens (e.g. a BOS) are added as its post-processor says, unless
    add_special_tokens=False."""

    def __init__(
        self, path: Path | _Tok, eos_token_id: int, chat_template: ChatTemplate | None = None
    ) -> None:
        self._tok = path if isinstance(path, _Tok) else _Tok.from_file(str(path))
        self.eos_token_id = eos_token_id
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template

    @property
    def backend(self):
        """The `tokenizers` object (its vocabulary and JSON: what constrained decoding reads)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def save(self, path: Path) -> None:
        """As a tokenizer.json file."""
        self._tok.save(str(path))


def load_tokenizer(
    model_dir: Path | None, eos_token_id: int, with_chat_template: bool = False
) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer of the presets (model_dir None), or a checkpoint's tokenizer.json;
    with_chat_template: also the checkpoint's chat template (only the router renders chats).
    A checkpoint without a tokenizer is refused: bytes are not its vocabulary."""
    if model_dir is None:
        return ByteTokenizer()
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(
            f"{model_dir}: no tokenizer.json; a checkpoint needs its tokenizer to be served "
            "(save it with the model: tokenizer.save_pretrained(dir))"
        )
    template = ChatTemplate.from_checkpoint(model_dir) if with_chat_template else None
    return HFTokenizer(model_dir / "tokenizer.json", eos_token_id, template)
