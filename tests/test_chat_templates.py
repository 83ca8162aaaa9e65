"""Chat templates render and label as ``transformers`` does: the assistant's header is never trained
(Llama 3's ``| trim``, an empty answer, an answer that the header happens to contain), a template's
``{% generation %}`` blocks say exactly which tokens are trained (``return_assistant_tokens_mask``),
and ``tojson``, loop controls, ``strftime_now`` and special tokens kept only in
``special_tokens_map.json`` render the same text."""

from __future__ import annotations

import json

import pytest
import transformers

from loom.config import ConfigError
from loom.data.chat import builtin_render, encode_example, segments, template_render
from loom.data.tokenizer import train_tokenizer

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|endoftext|>"]
TURN = "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
LLAMA3 = (  # as Llama 3's own template: every content trimmed
    "{{ bos_token }}{% for m in messages %}" + TURN + "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_MARKED = (  # the same, the assistant's text in {% generation %} blocks (TRL's assistant-only loss)
    "{{ bos_token }}{% for m in messages %}" + TURN + "{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}{% else %}{{ m['content'] | trim }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "how are you?"},
    {"role": "assistant", "content": " fine thanks\n"},  # trimmed by the template
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": ""},  # an empty answer
    {"role": "user", "content": "say it"},
    {"role": "assistant", "content": "assistant"},  # the header holds the answer's text
]


def _tokenizer_dir(path, template: str, config: dict | None = None, special: tuple[str, ...] = ()):
    path.mkdir()
    tok = train_tokenizer(["how are you? fine thanks and say it be brief assistant system user"] * 8, 300)
    tok.add_special_tokens([*SPECIAL, *special])
    tok.save(str(path / "tokenizer.json"))
    cfg = {"chat_template": template, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg | (config or {})))
    return tok


def _trained(text: str, spans: list[tuple[int, int]]) -> list[str]:
    return [text[a:b] for a, b in spans]


@pytest.mark.parametrize("template", [LLAMA3, LLAMA3_MARKED], ids=["turn by turn", "generation blocks"])
def test_only_the_answer_and_its_end_of_turn_are_trained(tmp_path, template):
    _tokenizer_dir(tmp_path / "tok", template)
    text, spans = segments({"messages": MESSAGES}, "x", "chat", template_render(str(tmp_path / "tok")))
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert _trained(text, spans) == ["fine thanks<|eot_id|>", "<|eot_id|>", "assistant<|eot_id|>"]


def test_generation_blocks_train_the_tokens_transformers_marks(tmp_path):
    tok = _tokenizer_dir(tmp_path / "tok", LLAMA3_MARKED)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")
    out = theirs.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    text, spans = segments({"messages": MESSAGES}, "x", "chat", template_render(str(tmp_path / "tok")))
    ids, mask = encode_example(tok, text, spans, tok.token_to_id("<|endoftext|>"), train_on_prompt=False)
    assert ids[:-1] == out["input_ids"]  # Loom appends its end-of-document token, trained
    assert mask[:-1] == out["assistant_masks"] and mask[-1] == 1
    assert sum(mask[:-1]) > 3


def test_templates_render_as_transformers_renders_them(tmp_path):
    """tojson (insertion order, non-ASCII and <&' kept), {% break %}, strftime_now; a bos_token kept
    only in special_tokens_map.json (an older save)."""
    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] }}{% if m.get('tool_calls') %} {{ m['tool_calls'] | tojson }}"
        "{% endif %}\n{% endfor %}{{ strftime_now('%Y') }}"
    )
    d = tmp_path / "tok"
    _tokenizer_dir(d, template)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["bos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    messages = [
        {"role": "user", "content": "find it"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "search", "arguments": {"q": "a<b & c'd", "n": "é"}}],
        },
        {"role": "tool", "content": "found"},
        {"role": "assistant", "content": "cut by the break"},
    ]
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(d)
    want = theirs.apply_chat_template(messages, tokenize=False)
    assert template_render(str(d))(messages) == want
    assert '{"q": "a<b & c\'d", "n": "é"}' in want and want.startswith("<|begin_of_text|>")


MISTRAL = (  # v0.3: no assistant header, " " + the trimmed answer + eos
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% else %} {{ m['content'] | trim }}{{ eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_MARKED = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% else %} {% generation %}{{ m['content'] | trim }}{{ eos_token }}{% endgeneration %}{% endif %}{% endfor %}"
)
PHI3 = (  # the eos_token closes a conversation without a generation prompt: renders are not prefixes
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)
R1 = (  # DeepSeek-R1: the generation prompt opens the thinking, the turns do not
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}"
    "{% else %}<|Assistant|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)
TOOLS = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
)
CHAT = [
    {"role": "user", "content": "how are you?"},
    {"role": "assistant", "content": "fine thanks"},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": ""},
]


def test_a_token_overlapping_the_answer_is_trained_as_transformers_marks_it(tmp_path):
    """Mistral writes " " + answer: the token " fine" starts on the space, inside no span if a token must
    start there; transformers marks every token a generation block overlaps, and so does Loom."""
    tok = _tokenizer_dir(tmp_path / "plain", MISTRAL, {"eos_token": "<|endoftext|>"})
    _tokenizer_dir(tmp_path / "marked", MISTRAL_MARKED, {"eos_token": "<|endoftext|>"})
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "marked")
    want = theirs.apply_chat_template(
        CHAT[:2], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    for d in ("plain", "marked"):
        text, spans = segments({"messages": CHAT[:2]}, "x", "chat", template_render(str(tmp_path / d)))
        ids, mask = encode_example(tok, text, spans, tok.token_to_id("<|endoftext|>"), train_on_prompt=False)
        assert ids[:-1] == want["input_ids"] and mask[:-1] == want["assistant_masks"], d
        assert tok.decode([i for i, m in zip(ids, mask) if m][:1]).strip() == "fine"


def test_a_closing_eos_and_an_opened_thinking_never_hide_or_train_the_turns(tmp_path):
    """Phi-3's template ends a conversation with eos_token, so a render is no prefix of the next: the
    turns are read before it (it was refused); DeepSeek-R1's generation prompt adds <think>: the
    assistant's header still is no part of the answer."""
    _tokenizer_dir(tmp_path / "phi3", PHI3, special=("<|user|>", "<|assistant|>", "<|end|>"))
    text, spans = segments({"messages": CHAT}, "x", "chat", template_render(str(tmp_path / "phi3")))
    assert text.endswith("<|end|>\n<|eot_id|>")
    assert _trained(text, spans) == ["fine thanks<|end|>\n", "<|end|>\n"]
    _tokenizer_dir(tmp_path / "r1", R1, special=("<|User|>", "<|Assistant|>", "<|end|>"))
    text, spans = segments({"messages": CHAT}, "x", "chat", template_render(str(tmp_path / "r1")))
    assert _trained(text, spans) == ["fine thanks<|end|>", "<|end|>"]


def test_a_records_tools_reach_the_template(tmp_path):
    """A record's ``tools`` render as transformers renders them (``tools=`` of apply_chat_template)."""
    d = tmp_path / "tok"
    _tokenizer_dir(d, TOOLS, special=("<|user|>", "<|assistant|>", "<|end|>"))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "string"}}}]
    text, _ = segments({"messages": CHAT[:2], "tools": tools}, "x", "chat", template_render(str(d)))
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(d)
    assert text == theirs.apply_chat_template(CHAT[:2], tools=tools, tokenize=False)
    assert text.startswith('tools: [{"type": "function"')


TOOL_CALLS = (  # as Qwen's templates: the reasoning, the content if any, then the tool calls
    "{% for m in messages %}<|user|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
    "{% for c in m.tool_calls %}<tool>{{ c.function | tojson }}</tool>{% endfor %}<|end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|user|>assistant\n{% endif %}"
)
OPENAI_CHAT = [  # as OpenAI's API and the datasets exported from it write a tool call
    {"role": "developer", "content": "use tools"},
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning": "look it up",
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "1", "name": None},
    {"role": "assistant", "content": "Sunny."},
]


def test_openai_tool_calls_render_and_train_as_transformers_does(tmp_path):
    """Null fields are dropped and ``reasoning`` is read as ``reasoning_content``, as transformers hands
    messages to a template: the text and the assistant mask equal ``apply_chat_template``'s (a record
    with ``"content": null`` was refused)."""
    d = tmp_path / "tok"
    tok = _tokenizer_dir(d, TOOL_CALLS, {"eos_token": "<|endoftext|>"}, special=("<|user|>", "<|end|>"))
    text, spans = segments({"messages": OPENAI_CHAT}, "x", "chat", template_render(str(d)))
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(d)
    assert text == theirs.apply_chat_template(OPENAI_CHAT, tokenize=False)
    assert "<think>look it up</think>" in text and '"name": "weather"' in text
    want = theirs.apply_chat_template(
        OPENAI_CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = encode_example(tok, text, spans, tok.token_to_id("<|endoftext|>"), train_on_prompt=False)
    assert ids[:-1] == want["input_ids"] and mask[:-1] == want["assistant_masks"]


def test_a_record_the_template_or_the_builtin_refuses_is_named_in_one_line(tmp_path):
    alternate = "{% for m in messages %}{% if loop.index0 % 2 != (m.role == 'assistant') %}" + (
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    _tokenizer_dir(tmp_path / "tok", alternate)
    render = template_render(str(tmp_path / "tok"))
    twice = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, *CHAT[1:2]]}
    with pytest.raises(
        ConfigError, match=r"^data.source: f.jsonl:3: the chat template .* roles must alternate\)$"
    ):
        segments(twice, "f.jsonl:3", "chat", render)
    tool_call = {"messages": OPENAI_CHAT[1:3]}
    with pytest.raises(ConfigError, match="assistant message whose content is missing .*built-in template"):
        segments(tool_call, "f.jsonl:4", "chat", builtin_render)
    with pytest.raises(ConfigError, match="ShareGPT turn from 'robot'"):  # ShareGPT's own speakers read
        segments({"conversations": [{"from": "robot", "value": "hi"}]}, "f.jsonl:5", "chat", render)
