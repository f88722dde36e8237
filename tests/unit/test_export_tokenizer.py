"""The byte tokenizer exported as Hugging Face files (what vLLM reads from a save_hf directory)
encodes and decodes exactly like pdd's ByteTokenizer, through `tokenizers` and transformers."""

from __future__ import annotations

import random

import pytest

from shared.model.export_hf import save_hf
from shared.model.tokenizer import ByteTokenizer, load_tokenizer
from tests.engine_util import make_engine

ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyz ABC.,;:!?'\"-_()[]{}<>|\\/@#$%^&*+=~`",
    "\t\n\r\x00\x01\x7f ",
    "éàüßñçøåœ€£¥©®°±µ¶·",  # 2-byte
    "日本語中文한국어ไทย✓→∑√∞",  # 3-byte
    "😀🚀🎉𝔘𝔫𝔦𝔠𝔬𝔡𝔢",  # 4-byte
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    chars = "".join(ALPHABETS)
    return ["".join(rng.choice(chars) for _ in range(rng.randint(0, 80))) for _ in range(n)] + [
        " x  y ",
        "  ",
        "",
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf(make_engine().model, tmp_path_factory.mktemp("ckpt"), byte_tokenizer=True)


def test_the_exported_files_encode_and_decode_as_the_byte_tokenizer(checkpoint):
    ours, exported = ByteTokenizer(), load_tokenizer(checkpoint, ByteTokenizer.eos_token_id)
    assert type(exported).__name__ == "HFTokenizer" and exported.vocab_size == ours.vocab_size
    for text in random_texts(300):
        ids = ours.encode(text)
        assert exported.encode(text) == ids == exported.encode(text, add_special_tokens=False)
        assert exported.decode(ids) == ours.decode(ids) == text


def test_special_tokens_have_the_byte_tokenizers_ids_and_decode_to_nothing(checkpoint):
    exported = load_tokenizer(checkpoint, ByteTokenizer.eos_token_id)
    ids = [ByteTokenizer.bos_token_id, *b"ok", ByteTokenizer.eos_token_id]
    assert exported.decode(ids) == ByteTokenizer().decode(ids) == "ok"


def test_partial_utf8_decodes_to_the_same_replacement_characters(checkpoint):
    ours, exported = ByteTokenizer(), load_tokenizer(checkpoint, ByteTokenizer.eos_token_id)
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 12))]
        assert exported.decode(ids) == ours.decode(ids), ids


def test_transformers_loads_the_same_tokenizer(checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    assert tok.bos_token_id == ByteTokenizer.bos_token_id and tok.eos_token_id == ByteTokenizer.eos_token_id
    for text in random_texts(50, seed=1):
        ids = ByteTokenizer().encode(text)
        assert tok(text)["input_ids"] == ids
        assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>\nhi\n<|assistant|>\n"
