"""Chat and instruction examples: read records, render them as text, mark the tokens trained on.

``data.format = "chat"``: records hold ``messages``, a list of ``{role, content}``; they are rendered
with the tokenizer directory's chat template (``chat_template.jinja``, where ``transformers``'
``save_pretrained`` writes it, which ``transformers`` prefers to ``chat_template`` of
``tokenizer_config.json``; a Jinja template rendered in a sandbox as ``transformers`` does, the
special tokens of ``tokenizer_config.json`` in scope), or, without one, the built-in
``<|role|>\\ncontent\\n`` per message. ``data.format = "prompt_completion"``: records hold ``prompt`` and
``completion``, rendered as their concatenation.

Labels: an example's tokens are trained on (mask 1) only inside the assistant turns or the
completion, and its closing end-of-document token; with ``data.train_on_prompt`` all of them. A
template that marks the assistant's text with ``{% generation %}`` blocks (what transformers'
``return_assistant_tokens_mask`` and TRL's assistant-only loss read) has exactly those trained, from
one render of the whole conversation. Otherwise the rendered turn of message i is
render(messages[:i+1]) minus render(messages[:i]), so the template must render conversations
incrementally (most chat models' do), and the assistant's part of it starts after the header the
template's generation prompt writes (render(messages[:i]) with ``add_generation_prompt``: Llama 3's
``<|start_header_id|>assistant<|end_header_id|>\n\n``, ChatML's ``<|im_start|>assistant\n``), the
end-of-turn markup included.

Templates render as in transformers: a sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop
controls, its ``tojson`` (insertion order, non-ASCII kept), ``raise_exception`` and
``strftime_now``, and the special tokens of ``tokenizer_config.json`` (else
``special_tokens_map.json``).

An example longer than ``seq_len + 1`` tokens is cut to that length (``data.overlong = "truncate"``)
or left out (``"drop"``); both are counted. A cut that leaves no trained token is left out (counted
as dropped).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from loom.config import ConfigError
from loom.data.corpus import JSON_FORMATS, json_records, load_saved, saved_dataset

# roles a message may have (OpenAI's "developer" and "function", Llama 3.1's "ipython"); only the
# assistant's turns are trained
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
# names a message's reasoning comes under, as transformers aliases them: the first is what templates read
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# the preparation rule's version, in prepared data's cache key: 4 = messages normalised as transformers
# does (keys of null value dropped, reasoning aliased) and data.max_corpus_mb applied to whole records;
# 3 = tokens overlapping the spans, after the generation prompt's header or inside the template's
# {% generation %} blocks (1 searched the content from the turn's start, 2 trained tokens starting in
# the spans)
# 5 = the tokenizer's start tokens before each example (data.bos), never trained
LABELS_VERSION = 5
Render = Callable[..., str]  # (messages, generation_prompt=...) -> text
ASSISTANT = "<|assistant|>\n"  # the built-in template's opening of an assistant turn
# private-use characters (plane 15, which no text of ours uses) bracketing what a template's
# {% generation %} blocks write, removed before tokenizing
GEN_OPEN, GEN_CLOSE = "\U000f8000", "\U000f8001"


def builtin_render(messages: list[dict[str, str]], generation_prompt: bool = False, **_: Any) -> str:
    """The built-in template: ``<|role|>\\ncontent\\n`` for each message (and :data:`ASSISTANT` with
    ``generation_prompt``)."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + (ASSISTANT if generation_prompt else "")


def generation_spans(text: str) -> tuple[str, list[tuple[int, int]]]:
    """``text`` without the :data:`GEN_OPEN` / :data:`GEN_CLOSE` marks, and the spans they bracketed."""
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    at, start = 0, -1
    for ch in text:
        if ch == GEN_OPEN:
            start = at
        elif ch == GEN_CLOSE:
            if start >= 0:
                spans.append((start, at))
            start = -1
        else:
            out.append(ch)
            at += 1
    return "".join(out), spans


def _environment() -> Any:
    """A Jinja sandbox as transformers renders chat templates in (the module doc)."""
    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: its output bracketed by the generation marks."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Callable[[], str]) -> str:
            return GEN_OPEN + caller() + GEN_CLOSE

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def template_render(tokenizer_path: str, generation_prompt: bool = False) -> Render | None:
    """The chat template of the tokenizer directory (module doc: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template``) as a render function, or None when the directory
    has no template; ``generation_prompt``: end with the template's opening of an assistant turn
    (``add_generation_prompt``, for generation)."""
    p = Path(tokenizer_path).expanduser()
    d = p if p.is_dir() else p.parent
    cfg_path, jinja = d / "tokenizer_config.json", d / "chat_template.jinja"
    tcfg: Any = {}
    if cfg_path.is_file():
        try:
            tcfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"data.tokenizer: {cfg_path} is not valid JSON ({e})") from None
    tcfg = tcfg if isinstance(tcfg, dict) else {}
    if jinja.is_file():
        try:
            template: Any = jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"data.tokenizer: {jinja} is not UTF-8 text ({e})") from None
        where = jinja
    else:
        template, where = tcfg.get("chat_template"), cfg_path
    if isinstance(template, list):  # named templates: the default one
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if not isinstance(template, str):
        return None
    try:
        from jinja2 import TemplateError
    except ImportError:
        raise ConfigError(
            f"data.tokenizer: {where} has a chat template; rendering it needs jinja2 (pip install jinja2)"
        ) from None
    try:
        compiled = _environment().from_string(template)
    except TemplateError as e:
        raise ConfigError(f"data.tokenizer: the chat template of {where} does not compile ({e})") from None
    smap = _read_json_object(d / "special_tokens_map.json")  # an older save keeps them there only
    special = {
        k: _token_text(tcfg.get(k)) or _token_text(smap.get(k))
        for k in ("bos_token", "eos_token", "pad_token", "unk_token")
    }

    def render(
        messages: list[dict[str, str]],
        generation_prompt: bool = generation_prompt,
        marks: bool = False,
        tools: Any = None,
    ) -> str:
        """The conversation as the template writes it (``marks``: with its {% generation %} marks;
        ``tools``: the record's tool schemas, None as transformers passes them without any)."""
        text = compiled.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=generation_prompt,
            **special,
        )
        return text if marks else text.replace(GEN_OPEN, "").replace(GEN_CLOSE, "")

    render.special_tokens = tuple(t for t in special.values() if t)  # type: ignore[attr-defined]
    return render


def _read_json_object(path: Path) -> dict:
    """A JSON object file's content, or {} where it is missing or not one."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _token_text(value: Any) -> str:
    """A special token of ``tokenizer_config.json``: a string, or an AddedToken object with ``content``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def read_records(files: list[Path]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of every JSON record (:func:`~loom.data.corpus.json_records`: JSON Lines, or a
    ``.json`` array), ``.parquet`` row or row of a ``datasets`` save_to_disk directory (or loose
    ``.arrow`` file), in file order."""
    for path in files:
        if path.name.endswith(JSON_FORMATS):
            for where, record in json_records(path):
                if not isinstance(record, dict):
                    raise ConfigError(
                        f"data.source: {where} is a JSON {type(record).__name__}, not an object"
                    )
                yield where, record
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            row = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
                for record in batch.to_pylist():
                    yield f"{path} row {row}", record
                    row += 1
        elif saved_dataset(path) or (path.suffix == ".arrow" and path.is_file()):
            ds = load_saved(path)
            for start in range(0, len(ds), 256):  # a slice: a dict of columns, memory-mapped underneath
                columns = ds[start : start + 256]
                for i, values in enumerate(zip(*columns.values())):
                    yield f"{path} row {start + i}", dict(zip(columns, values))
        else:
            raise ConfigError(
                f"data.format: chat and prompt_completion read .jsonl, .json or .parquet records or a datasets "
                f"save_to_disk directory, not {path}"
            )


def segments(
    record: dict[str, Any], where: str, fmt: str, render: Render
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered example and the character spans trained on (assistant turns or the completion)."""
    if fmt == "prompt_completion":
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise ConfigError(
                    f"data.source: {where} has no string field {key!r} (data.format = prompt_completion)"
                )
        text = record["prompt"] + record["completion"]
        return text, [(len(record["prompt"]), len(text))]
    messages = normalized_messages(record, where, builtin=render is builtin_render)
    render = partial(_refusals_named(render, where), tools=record.get("tools"))
    if render.func is not builtin_render:
        text, marked = generation_spans(render(messages, marks=True))
        if marked:  # the template says which text is the assistant's ({% generation %})
            return text, marked
    spans: list[tuple[int, int]] = []
    prev, tail = "", ""
    for i, m in enumerate(messages):
        cur = render(messages[: i + 1])
        if not cur.startswith(prev):
            # a closing text every render ends with but the next continues from before it (Phi-3's
            # eos_token when no generation prompt follows): the turns end where it starts
            tail = _closing_tail(prev, cur, getattr(render.func, "special_tokens", ()))
            kept = len(prev) - len(tail)
            if not tail:
                raise ConfigError(
                    f"data.tokenizer: the chat template does not render {where} turn by turn (turn {i} "
                    "changes the text before it); use a template that extends the conversation, or one "
                    "that marks the assistant's text with {% generation %} blocks"
                )
            prev = prev[:kept]
            spans = [(a, min(b, kept)) for a, b in spans]
        if m["role"] == "assistant":
            content = m.get("content")
            start = _answer_start(
                render, messages[:i], prev, cur, content if isinstance(content, str) else ""
            )
            spans.append((start, len(cur)))
        prev = cur
    if tail and prev.endswith(tail):
        spans = [(a, min(b, len(prev) - len(tail))) for a, b in spans]
    return prev, spans


# ShareGPT's speakers (``conversations`` of ``{"from", "value"}``, as Axolotl and LLaMA-Factory read them)
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "observation": "tool",
    "tool": "tool",
}


def sharegpt_messages(record: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A ShareGPT record's ``conversations`` as ``messages`` (:data:`SHAREGPT_ROLES`; a top-level
    ``system`` string first); a speaker it does not know, a turn that is not ``{"from", "value"}`` or one
    with a per-turn ``weight`` (not read: it would train what the data says not to) is refused naming it."""
    out = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
    for turn in record["conversations"]:
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise ConfigError(f"data.source: {where} has a ShareGPT turn that is not an object of from/value")
        if "weight" in turn:
            raise ConfigError(
                f"data.source: {where} has a ShareGPT turn with a 'weight', which Loom does not read "
                "(every assistant turn trains): drop the turns not to train on, or the key"
            )
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise ConfigError(
                f"data.source: {where} has a ShareGPT turn from {turn['from']!r} "
                f"(allowed: {', '.join(SHAREGPT_ROLES)})"
            )
        out.append({"role": role, "content": turn["value"]})
    return out


def normalized_messages(record: dict[str, Any], where: str, builtin: bool) -> list[dict[str, Any]]:
    """The record's ``messages`` (or ShareGPT's ``conversations``: :func:`sharegpt_messages`) as
    transformers hands them to a template: keys of null value dropped (OpenAI's ``"content": null``
    beside ``tool_calls``), the reasoning under every name of :data:`REASONING_FIELDS` (and
    ``thinking``, which gpt-oss reads); checked: a known role, string content (or, for a template,
    content blocks, or none), an assistant turn."""
    messages = record.get("messages")
    if messages is None and isinstance(record.get("conversations"), list) and record["conversations"]:
        messages = sharegpt_messages(record, where)
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            f"data.source: {where} has no list field 'messages' (data.format = chat; or ShareGPT's "
            "'conversations' of from/value)"
        )
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict):
            raise ConfigError(
                f"data.source: {where} has a message that is a {type(m).__name__}, not an object"
            )
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("role") not in ROLES:
            raise ConfigError(
                f"data.source: {where} has a message of unknown role {m.get('role')!r} "
                f"(allowed: {', '.join(ROLES)})"
            )
        content = m.get("content")
        if not isinstance(content, str) and (builtin or not isinstance(content, list | type(None))):
            what = "the built-in template renders string content only; give data.tokenizer a chat template"
            raise ConfigError(
                f"data.source: {where} has a {m['role']} message whose content is "
                f"{type(content).__name__ if content is not None else 'missing'} "
                f"({what if builtin else 'allowed: a string, a list of content blocks, or none'})"
            )
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        raise ConfigError(f"data.source: {where} has no assistant turn: nothing to train on")
    return out


def _refusals_named(render: Render, where: str) -> Render:
    """``render``, with a template's refusal of the record (its ``raise_exception``, or an error it runs
    into) raised as one line naming the record."""
    if render is builtin_render:
        return render

    def named(messages: list[dict[str, Any]], **kw: Any) -> str:
        try:
            return render(messages, **kw)
        except Exception as e:  # jinja2's TemplateError, or what a template's expression raised
            raise ConfigError(
                f"data.source: {where}: the chat template of data.tokenizer refuses it, rendering its "
                f"first {len(messages)} message(s) ({type(e).__name__}: {e})"
            ) from None

    named.special_tokens = getattr(render, "special_tokens", ())  # type: ignore[attr-defined]
    return named


def _closing_tail(prev: str, cur: str, special: tuple[str, ...]) -> str:
    """The text ``prev`` ends with that ``cur`` also ends with but continues from before (a template's
    closing eos_token), or "": a special token where one fits (text alone cannot tell ``<|eot|>`` from
    ``eot|>`` after a shared ``<|``), else what follows their common prefix."""
    for t in sorted(special, key=len, reverse=True):
        if prev.endswith(t) and cur.endswith(t) and cur.startswith(prev[: len(prev) - len(t)]):
            return t
    tail = prev[len(_common_prefix(prev, cur)) :]
    return tail if tail and cur.endswith(tail) else ""


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def _answer_start(render: Render, before: list[dict[str, str]], prev: str, cur: str, content: str) -> int:
    """Where the assistant's part of its rendered turn ``cur`` (after ``prev``) starts: after the
    header the template's generation prompt writes for it, where ``cur`` begins with it; else (a
    template whose prompt differs from its turns) where ``content`` first occurs in the turn, else
    where the turn starts."""
    try:
        head = render(before, generation_prompt=True)
    except Exception:  # a template that refuses a conversation ending before an assistant turn
        head = ""
    if len(head) > len(prev) and cur.startswith(head):
        return len(head)
    # DeepSeek-R1's prompt opens its thinking too: the header is what both share, back to where its
    # markup ends ("<think>" and "<|end|>" share a "<" that is no part of the header)
    shared = len(_common_prefix(head, cur))
    while shared > len(prev) and cur[shared - 1] not in ">]\n ":
        shared -= 1
    if shared > len(prev):
        return shared
    at = cur.find(content, len(prev)) if content else -1
    return at if at >= 0 else len(prev)


def encode_example(
    tok: Tokenizer,
    text: str,
    spans: list[tuple[int, int]],
    eot: int,
    train_on_prompt: bool,
    bos: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """Token ids of ``bos`` + ``text`` + the end token (``bos`` left out where the text's own tokens
    begin with it: a chat template writing ``{{ bos_token }}``), and the mask (1 = trained: a token
    overlapping a span, as transformers' assistant mask counts it: Mistral's " fine" starts on the
    space before the answer; ``bos`` never, unless ``train_on_prompt``)."""
    enc = tok.encode(text, add_special_tokens=False)
    head = [] if list(enc.ids[: len(bos)]) == list(bos) else list(bos)
    ids = [*head, *enc.ids, eot]
    if train_on_prompt:
        return ids, [1] * len(ids)
    mask = [int(any(start < b and end > a for a, b in spans)) for start, end in enc.offsets]
    return ids, [0] * len(head) + [*mask, 1 if spans else 0]


class ExampleEncoder:
    """Encodes examples into (ids, mask) chunks, counting those cut or dropped for length."""

    def __init__(
        self,
        tok: Tokenizer,
        eot: int,
        dtype: np.dtype,
        max_tokens: int,
        overlong: str,
        train_on_prompt: bool,
        bos: Sequence[int] = (),
    ) -> None:
        self.tok, self.eot, self.dtype, self.bos = tok, eot, dtype, tuple(bos)
        self.max_tokens, self.overlong, self.train_on_prompt = max_tokens, overlong, train_on_prompt
        self.truncated = self.dropped = 0

    def __call__(
        self, examples: list[tuple[str, list[tuple[int, int]]]]
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """(ids, mask, examples kept) of a chunk of (text, spans)."""
        ids: list[int] = []
        mask: list[int] = []
        kept = 0
        for text, spans in examples:
            one, m = encode_example(self.tok, text, spans, self.eot, self.train_on_prompt, self.bos)
            if len(one) > self.max_tokens:
                if self.overlong == "drop":
                    self.dropped += 1
                    continue
                one, m = one[: self.max_tokens], m[: self.max_tokens]
                if not any(m):  # cut inside the prompt: nothing left to train on
                    self.dropped += 1
                    continue
                self.truncated += 1
            ids += one
            mask += m
            kept += 1
        return np.asarray(ids, dtype=self.dtype), np.asarray(mask, dtype=np.uint8), kept
