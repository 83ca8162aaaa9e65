"""Chat and instruction examples: read records, render them as text, mark the tokens trained on.

``data.format = "chat"``: records hold ``messages``, a list of ``{role, content}``; they are rendered
with the tokenizer directory's chat template (``chat_template.jinja``, where ``transformers``'
``save_pretrained`` writes it, which ``transformers`` prefers to ``chat_template`` of
``tokenizer_config.json``; a Jinja template rendered in a sandbox as ``transformers`` does, the
special tokens of ``tokenizer_config.json`` in scope), or, without one, the built-in
``<|role|>\\ncontent\\n`` per message. ``data.format = "prompt_completion"``: records hold ``prompt`` and
``completion``, rendered as their concatenation.

Labels: an example's tokens are trained on (mask 1) only inside the assistant turns (from the start
of each assistant message's content to the end of its rendered turn, end-of-turn markup included)
or the completion, and its closing end-of-document token; with ``data.train_on_prompt`` all of them.
The rendered turn of message i is render(messages[:i+1]) minus render(messages[:i]), so a template
must render conversations incrementally (every template of a chat model does).

An example longer than ``seq_len + 1`` tokens is cut to that length (``data.overlong = "truncate"``)
or left out (``"drop"``); both are counted. A cut that leaves no trained token is left out (counted
as dropped).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from loom.config import ConfigError
from loom.data.corpus import parse_json_line

ROLES = ("system", "user", "assistant", "tool")
Render = Callable[[list[dict[str, str]]], str]


def builtin_render(messages: list[dict[str, str]]) -> str:
    """The built-in template: ``<|role|>\\ncontent\\n`` for each message."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)


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
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError(
            f"data.tokenizer: {where} has a chat template; rendering it needs jinja2 (pip install jinja2)"
        ) from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except TemplateError as e:
        raise ConfigError(f"data.tokenizer: the chat template of {where} does not compile ({e})") from None
    special = {k: _token_text(tcfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def render(messages: list[dict[str, str]]) -> str:
        return compiled.render(messages=messages, add_generation_prompt=generation_prompt, **special)

    return render


def _token_text(value: Any) -> str:
    """A special token of ``tokenizer_config.json``: a string, or an AddedToken object with ``content``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def read_records(files: list[Path]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of every ``.jsonl`` line or ``.parquet`` row, in file order."""
    for path in files:
        if path.suffix == ".jsonl":
            with path.open("rb") as f:
                for lineno, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    where = f"{path}:{lineno}"
                    record = parse_json_line(raw, where)
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
        else:
            raise ConfigError(
                f"data.format: chat and prompt_completion read .jsonl or .parquet records, not {path}"
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
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"data.source: {where} has no list field 'messages' (data.format = chat)")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ConfigError(f"data.source: {where} has a message without string 'content'")
        if m.get("role") not in ROLES:
            raise ConfigError(
                f"data.source: {where} has a message of unknown role {m.get('role')!r} "
                f"(allowed: {', '.join(ROLES)})"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"data.source: {where} has no assistant turn: nothing to train on")
    spans, prev = [], ""
    for i, m in enumerate(messages):
        cur = render(messages[: i + 1])
        if not cur.startswith(prev):
            raise ConfigError(
                f"data.tokenizer: the chat template does not render {where} turn by turn (turn {i} "
                "changes the text before it); use a template that extends the conversation"
            )
        if m["role"] == "assistant":
            at = cur.find(m["content"], len(prev)) if m["content"] else -1
            spans.append((at if at >= 0 else len(prev), len(cur)))
        prev = cur
    return prev, spans


def encode_example(
    tok: Tokenizer, text: str, spans: list[tuple[int, int]], eot: int, train_on_prompt: bool
) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` + the end token, and the mask (1 = trained: a token starting inside a span)."""
    enc = tok.encode(text, add_special_tokens=False)
    ids = [*enc.ids, eot]
    if train_on_prompt:
        return ids, [1] * len(ids)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offsets]
    return ids, [*mask, 1 if spans else 0]


class ExampleEncoder:
    """Encodes examples into (ids, mask) chunks, counting those cut or dropped for length."""

    def __init__(
        self, tok: Tokenizer, eot: int, dtype: np.dtype, max_tokens: int, overlong: str, train_on_prompt: bool
    ) -> None:
        self.tok, self.eot, self.dtype = tok, eot, dtype
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
            one, m = encode_example(self.tok, text, spans, self.eot, self.train_on_prompt)
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
