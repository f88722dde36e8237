"""Checkpoint chat templates: rendered byte for byte as transformers' apply_chat_template does
(transformers, a dev dependency, gives the reference), the template forms a checkpoint may ship,
a template's refusal as a 400, and the built-in layout when there is no template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from services.router.api.openai_request import chat_prompt, parse_request
from services.router.api.tool_request import default_parser
from services.router.core.errors import APIError
from shared.config import ModelSettings
from shared.model.chat_template import ChatTemplate
from shared.model.describe import describe_model
from shared.model.tokenizer import load_tokenizer

# Modelled on Llama 3.1's template: BOS from the template, a dated system header, tools as JSON.
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'tool' or message.role == 'ipython' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Modelled on Qwen3's template: no BOS, tools in the system turn, <think> on the last answer,
# tool results grouped into one user turn.
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# What the real templates above leave out: block whitespace control, {% break %}, {% generation %},
# the other special tokens, `documents`, and message keys that are absent rather than null.
EXTRAS = """{% for message in messages %}
  {% if message.role == 'system' %}{% continue %}{% endif %}
  [{{ message.role }}{% if message.name is defined %} name={{ message.name }}{% endif %}
  {%- if message.tool_call_id is defined %} id={{ message.tool_call_id }}{% endif %}]
  {% generation %} {{ message.content | tojson }} {% endgeneration %}

  {% if message.content == 'stop' %}{% break %}{% endif %}
{% endfor %}
docs={{ documents is defined }}/{{ documents is none }} tools={{ tools }} unk={{ unk_token }} pad={{ pad_token }}
{% if add_generation_prompt %}{{ eos_token }}>{% endif %}
"""

RAISES = """{% for message in messages %}
{% if message.role == 'user' and message.content == '' %}
{{ raise_exception('Empty user turn at position ' ~ loop.index0) }}
{% endif %}{{ message.content }}
{% endfor %}"""

LLAMA_TOKENS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
QWEN_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CONVERSATIONS = {
    "system+user": [
        {"role": "system", "content": "  You are terse.\n"},
        {"role": "user", "content": "What is 2+2? <b>&</b> 'é' ✓"},
    ],
    "multi-turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nHello! How can I help?"},
        {"role": "user", "content": "Tell me a joke.\n"},
        {"role": "assistant", "content": "No."},
        {"role": "user", "content": "stop"},
        {"role": "user", "content": "Please?"},
    ],
    "tool": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        },
        {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1", "name": "weather"},
        {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_2", "name": None},
    ],
    "user only": [{"role": "user", "content": "hello"}],
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather <now> & 'here' in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def write_checkpoint(tmp: Path, specials: list[str], bos: str | None, eos: str, **config) -> Path:
    """A byte-level BPE tokenizer with the special tokens, saved as transformers saves one, and
    `config` merged into tokenizer_config.json. A BOS, when given, is added by the post-processor."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    if bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tk.token_to_id(bos))]
        )
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos).save_pretrained(
        tmp
    )
    path = tmp / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return tmp


def llama(tmp: Path, template: str = LLAMA3, **config) -> Path:
    return write_checkpoint(
        tmp, LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>", chat_template=template, **config
    )


def qwen(tmp: Path, template: str = QWEN, **config) -> Path:
    return write_checkpoint(
        tmp, QWEN_TOKENS, None, "<|im_end|>", chat_template=template, pad_token="<|endoftext|>", **config
    )


def reference(path: Path, messages: list[dict], **kwargs) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def parse_chat(tokenizer, body: dict):
    return parse_request(
        json.dumps(body).encode(),
        True,
        model_id="m",
        tokenizer=tokenizer,
        max_model_len=1 << 16,
        max_tokens_default=16,
    )


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("make", [llama, qwen], ids=["llama3", "qwen"])
def test_renders_like_transformers(tmp_path, make, conversation):
    path = make(tmp_path)
    messages = CONVERSATIONS[conversation]
    template = ChatTemplate.from_checkpoint(path)
    assert template.render(messages) == reference(path, messages, add_generation_prompt=True)
    assert template.render(messages, add_generation_prompt=False) == reference(path, messages)


@pytest.mark.parametrize("make", [llama, qwen], ids=["llama3", "qwen"])
def test_tools_render_like_transformers(tmp_path, make):
    path = make(tmp_path)
    messages = CONVERSATIONS["system+user"]
    rendered = ChatTemplate.from_checkpoint(path).render(messages, tools=TOOLS)
    assert "<now> & 'here' in °C" in rendered  # JSON as is, not HTML-escaped
    assert rendered == reference(path, messages, add_generation_prompt=True, tools=TOOLS)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_environment_and_variables_match_transformers(tmp_path, conversation):
    path = write_checkpoint(
        tmp_path,
        QWEN_TOKENS + ["<unk>"],
        None,
        "<|im_end|>",
        chat_template=EXTRAS,
        unk_token="<unk>",
        pad_token={"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
    )
    messages = CONVERSATIONS[conversation]
    rendered = ChatTemplate.from_checkpoint(path).render(messages)
    assert "pad=<|endoftext|>" in rendered and "docs=True/True" in rendered
    assert rendered == reference(path, messages, add_generation_prompt=True)


def test_special_tokens_from_the_map_file_and_model_specific_ones(tmp_path):
    """An older checkpoint's special_tokens_map.json, `*_token` entries and named extra tokens."""
    template = "{{ bos_token }}|{{ unk_token }}|{{ image_token }}|{{ audio_token }}|{{ messages[0].content }}"
    path = llama(
        tmp_path, template=template, image_token="<img>", extra_special_tokens={"audio_token": "<au>"}
    )
    legacy = {"bos_token": {"content": "<|eot_id|>", "special": True}, "unk_token": "<unk>"}
    (path / "special_tokens_map.json").write_text(json.dumps(legacy))
    rendered = ChatTemplate.from_checkpoint(path).render(CONVERSATIONS["user only"])
    assert rendered == "<|eot_id|>|<unk>|<img>|<au>|hello" == reference(path, CONVERSATIONS["user only"])


def test_router_prompt_ids_are_transformers_ids_with_one_bos(tmp_path):
    """Text parts are joined with newlines (as vLLM does), the null `name` is dropped, and the
    template's BOS is the only one although the tokenizer's post-processor adds one."""
    path = llama(tmp_path)
    tokenizer = load_tokenizer(path, eos_token_id=0, with_chat_template=True)
    body = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}],
                "name": None,
            },
        ]
    }
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Part one.\nPart two."},
    ]
    ref = transformers.AutoTokenizer.from_pretrained(path)
    ids = ref.apply_chat_template(expected, add_generation_prompt=True, return_dict=False)
    assert parse_chat(tokenizer, body).prompt_ids == ids
    bos = ref.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1
    assert tokenizer.encode("x") == [bos, ref.convert_tokens_to_ids("x")]  # (plain text still gets its BOS)


def test_describe_model_gives_the_router_the_template(tmp_path):
    path = qwen(tmp_path)
    transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=300,
        eos_token_id=2,
    ).save_pretrained(path)
    tokenizer = describe_model(ModelSettings(path=str(path))).tokenizer
    messages = CONVERSATIONS["multi-turn"]
    ids = parse_chat(tokenizer, {"messages": messages}).prompt_ids
    assert ids == transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )


def test_template_list_form_uses_default_and_tool_use_for_tools(tmp_path):
    named = [
        {"name": "tool_use", "template": "TOOLS {{ tools | length }}"},
        {"name": "default", "template": QWEN},
    ]
    path = qwen(tmp_path, template=named)
    messages = CONVERSATIONS["tool"]
    template = ChatTemplate.from_checkpoint(path)
    assert template.render(messages) == reference(path, messages, add_generation_prompt=True)
    assert template.render(messages, tools=TOOLS) == "TOOLS 1" == reference(path, messages, tools=TOOLS)


def test_jinja_file_wins_over_tokenizer_config(tmp_path):
    path = llama(tmp_path, template="from tokenizer_config.json")
    (path / "chat_template.jinja").write_text(QWEN)
    messages = CONVERSATIONS["multi-turn"]
    rendered = ChatTemplate.from_checkpoint(path).render(messages)
    assert rendered.startswith("<|im_start|>system") and rendered == reference(
        path, messages, add_generation_prompt=True
    )


def test_jinja_file_alone_is_enough(tmp_path):
    path = write_checkpoint(tmp_path, LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>")
    assert ChatTemplate.from_checkpoint(path) is None
    (path / "chat_template.jinja").write_text(LLAMA3)
    messages = CONVERSATIONS["tool"]
    assert ChatTemplate.from_checkpoint(path).render(messages) == reference(
        path, messages, add_generation_prompt=True
    )


def test_raise_exception_is_a_400_naming_the_problem(tmp_path):
    tokenizer = load_tokenizer(llama(tmp_path, template=RAISES), eos_token_id=0, with_chat_template=True)
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": ""}]},
        ]
    }
    with pytest.raises(APIError) as err:
        parse_chat(tokenizer, body)
    assert err.value.status == 400 and err.value.param == "messages"
    assert str(err.value) == "chat template: Empty user turn at position 1"
    assert parse_chat(
        tokenizer, {"messages": body["messages"][:1]}
    ).prompt_ids  # the same template renders others


def test_template_runtime_error_is_a_400(tmp_path):
    tokenizer = load_tokenizer(
        llama(tmp_path, template="{{ messages[0].content.nothing() }}"), 0, with_chat_template=True
    )
    with pytest.raises(APIError) as err:
        parse_chat(tokenizer, {"messages": [{"role": "user", "content": "hi"}]})
    assert (
        err.value.status == 400
        and str(err.value).startswith("chat template: ")
        and "nothing" in str(err.value)
    )


def test_template_cannot_reach_python_internals(tmp_path):
    tokenizer = load_tokenizer(
        llama(tmp_path, template="{{ messages.__class__.__mro__ }}"), 0, with_chat_template=True
    )
    with pytest.raises(APIError) as err:
        parse_chat(tokenizer, {"messages": [{"role": "user", "content": "hi"}]})
    assert err.value.status == 400 and "__class__" in str(err.value)


def test_a_template_that_does_not_compile_is_refused_at_load(tmp_path):
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.from_checkpoint(llama(tmp_path, template="{% for m in messages %}"))


def test_only_text_content_parts_are_accepted(tmp_path):
    tokenizer = load_tokenizer(llama(tmp_path), eos_token_id=0, with_chat_template=True)
    part = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(APIError) as err:
        parse_chat(tokenizer, {"messages": [{"role": "user", "content": [part]}]})
    assert err.value.status == 400 and "only text is supported" in str(err.value)


def test_without_a_template_chat_keeps_the_plain_layout(tmp_path):
    path = write_checkpoint(tmp_path, LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>")
    tokenizer = load_tokenizer(path, eos_token_id=0, with_chat_template=True)
    assert tokenizer.chat_template is None
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    layout = "<|system|>\nsys\n<|user|>\nhi\n<|tool|>\n42\n<|assistant|>\n"
    parsed = parse_chat(tokenizer, {"messages": messages})
    assert chat_prompt(parsed.body.messages) == layout
    assert parsed.prompt_ids == tokenizer.encode(layout)  # (with the post-processor's BOS)
    preset = describe_model(ModelSettings(preset="tiny")).tokenizer
    assert preset.chat_template is None
    assert parse_chat(preset, {"messages": messages}).prompt_ids == list(layout.encode())


# Qwen2.5's way with tools: the tools listed, an assistant's calls as <tool_call> JSON, the results.
TOOL_TURNS = """{%- for t in tools %}T {{ t.function.name }} {{ t.function.parameters | tojson }}
{% endfor %}
{%- for m in messages %}<{{ m.role }}>{{ m.content }}
{%- for c in m.tool_calls or [] %}<tool_call>{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>{% endfor %}
{% endfor %}"""


def test_a_chat_requests_tools_and_tool_turns_reach_the_template(tmp_path):
    """`tools` and the history's calls and results render as transformers renders them with
    the same tools and the calls' arguments as objects (vLLM's hand-over); the template's
    `<tool_call>` makes hermes the default parser."""
    path = write_checkpoint(tmp_path, QWEN_TOKENS, None, "<|im_end|>", chat_template=TOOL_TURNS)
    tokenizer = load_tokenizer(path, eos_token_id=0, with_chat_template=True)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    }
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1"},
        ],
        "tools": TOOLS,
    }
    as_objects = {**call, "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    expected = [
        body["messages"][0],
        {"role": "assistant", "content": "", "tool_calls": [as_objects]},
        body["messages"][2],
    ]
    ref = transformers.AutoTokenizer.from_pretrained(path)
    text = ref.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "T weather" in text and '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}' in text
    assert parse_chat(tokenizer, body).prompt_ids == ref.encode(text, add_special_tokens=False)
    assert default_parser(tokenizer.chat_template.source) == "hermes"
