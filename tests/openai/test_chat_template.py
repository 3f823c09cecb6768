"""tgi_compat.api.serving.chat.template: prompts equal transformers' apply_chat_template, TGI's context and rewrites."""

from __future__ import annotations

import json

import pytest

from tgi_compat.api.config import ServerConfig
from tgi_compat.api.protocol.errors import TgiError
from tgi_compat.api.protocol.openai import ChatRequest
from tgi_compat.api.serving.chat.template import ChatTemplate, load_chat_template, template_messages

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome"},
        {"role": "user", "content": "And of Spain? Ünïcødé ✓"},
    ],
]


@pytest.fixture(scope="module")
def smol_template(smollm2_tokenizer) -> ChatTemplate:
    template = load_chat_template(ServerConfig(), smollm2_tokenizer)
    assert template is not None
    return template


def _messages(raw: list[dict]) -> list[dict[str, str]]:
    return template_messages(ChatRequest.model_validate({"messages": raw}, strict=True).messages)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_prompt_equals_transformers_apply_chat_template(smol_template, smollm2_tokenizer, conversation):
    expected = smollm2_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert smol_template.render(_messages(conversation)) == expected
    assert smol_template.bos_token == "<|im_start|>" and smol_template.eos_token == "<|im_end|>"


def test_final_assistant_message_is_continued_like_transformers(smol_template, smollm2_tokenizer):
    conversation = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "My favourite color is  "},
    ]
    expected = smollm2_tokenizer.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    rendered = smol_template.render(_messages(conversation))
    assert rendered == expected.rstrip()  # TGI also right-trims the cut prompt
    assert rendered.endswith("<|im_start|>assistant\nMy favourite color is")


def test_content_is_flattened_like_tgi():
    raw = [
        {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, {"type": "text", "text": " please"}]},
        {"role": "assistant", "tool_calls": [{"id": "0", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
    ]  # fmt: skip
    flat = _messages(raw)
    assert flat[0] == {"role": "user", "content": "Describe ![](https://x/cat.png) please"}
    calls = json.loads(flat[1]["content"])
    assert calls == [
        {"id": "0", "type": "function", "function": {"description": None, "name": "f", "arguments": '{"a":1}'}}
    ]


def test_sandbox_globals_and_tojson():
    template = ChatTemplate.create(
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}{{ strftime_now('%Y') | length }}",
        "<s>",
        "</s>",
    )
    rendered = template.render([{"role": "user", "content": "<b>&"}])
    assert rendered == '<s>{"role": "user", "content": "<b>&"}4'  # no HTML escaping, transformers' tojson


def test_trim_and_lstrip_blocks_like_transformers():
    template = ChatTemplate.create("  {% for m in messages %}\n{{ m.content }}\n  {% endfor %}\n", None, None)
    assert template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"


def test_raise_exception_is_a_template_error():
    template = ChatTemplate.create(
        "\n{% if messages[0].role != 'system' %}{{ raise_exception('System first') }}{% endif %}", None, None
    )
    with pytest.raises(TgiError) as caught:
        template.render([{"role": "user", "content": "hi"}])
    error = caught.value
    assert (error.status, error.error_type) == (422, "template_error")
    assert error.message == "Template error: syntax error: System first (in <string>:2)"


def test_tgi_source_rewrites():
    # Flat string contents, Qwen3's reversed loop and training-only generation tags.
    source = (
        "{% generation %}{{ messages[0]['content'][0]['text'] }}{% endgeneration %}"
        "{% for m in messages[::-1] %}|{{ m.role }}{% endfor %}"
    )
    template = ChatTemplate.create(source, None, None)
    assert "|reverse" in template.source and "generation" not in template.source
    assert (
        template.render([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "x"}])
        == "hello|assistant|user"
    )


def test_template_sources_override_and_named_list(tmp_path, smollm2_tokenizer):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": named, "eos_token": {"content": "</e>"}})
    )
    config = ServerConfig(model_id=str(folder))
    assert load_chat_template(config, smollm2_tokenizer).render([]) == "D</e>"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert load_chat_template(config, smollm2_tokenizer).render([]) == "J"
    override = tmp_path / "override.jinja"
    override.write_text("O{{ messages | length }}")
    config.chat_template = str(override)  # --chat-template FILE
    assert load_chat_template(config, smollm2_tokenizer).render([]) == "O0"
    config.chat_template = "inline {{ add_generation_prompt }}"  # --chat-template STRING
    assert load_chat_template(config, smollm2_tokenizer).render([]) == "inline True"


# Template features real models use: whitespace control, namespace(), loop.last, tojson, bos/eos
# and raise_exception (written for this test, in the style of Llama 3 / Qwen 2.5 templates).
FEATURE_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- set ns = namespace(system='Default system.') %}\n"
    "{%- if messages and messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}\n"
    "<sys>{{ ns.system | trim }}</sys>\n"
    "{%- for message in messages if message.role != 'system' %}\n"
    "    {%- if message.role not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n"
    "    {{- '\\n[' + message.role | upper + '] ' + message.content | tojson }}\n"
    "    {%- if message.role == 'assistant' and not loop.last %}{{ eos_token }}{% endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n[ASSISTANT]{% endif %}\n"
)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_feature_template_equals_transformers(smollm2_tokenizer, conversation):
    template = ChatTemplate.create(FEATURE_TEMPLATE, smollm2_tokenizer.bos_token, smollm2_tokenizer.eos_token)
    expected = smollm2_tokenizer.apply_chat_template(
        conversation, chat_template=FEATURE_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert template.render(_messages(conversation)) == expected
