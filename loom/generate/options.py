"""The options of ``loom generate`` and its prompt files, checked without torch (one line per bad value).

Sampling of the next token from logits z (V,): first, with ``repetition_penalty`` = r != 1, the
logit of every token already in the sequence (prompt included) divided by r where positive,
multiplied by r where negative (as ``transformers``' RepetitionPenaltyLogitsProcessor); then greedy
argmax when ``temperature`` = 0; else z / temperature, then with ``top_k`` = k > 0 only the k
largest, then with ``top_p`` = p < 1 only the smallest set of most probable tokens whose
probabilities sum to >= p (nucleus), then one draw from the softmax of what is left with the
prompt's own generator seeded by ``seed`` (so a prompt gives the same text alone or in a batch).

An option left unset (None) takes the model's default (its ``generation_config.json``:
loom.generate.source), else Loom's (:data:`BUILTIN`); a value given always wins.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from loom.config import ConfigError

Prompt = str | list[dict[str, str]]  # text, or chat messages [{role, content}, ...]


# Loom's own defaults of the options a model's generation_config.json may set
BUILTIN: dict[str, float] = {"temperature": 0.8, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}


class Rule(NamedTuple):
    """The next-token rule (module doc), every option set."""

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int = 200  # tokens generated per prompt at most (unset: at most model.max_seq_len)
    temperature: float | None = None  # 0 = greedy; None: the model's, else 0.8
    top_k: int | None = None  # keep the k most likely tokens (0 = all); None: the model's, else 50
    top_p: float | None = None  # nucleus: the likeliest up to this mass (1 = all); None: model's, else 1
    seed: int = 0  # seed of each prompt's generator
    stop: tuple[str, ...] = ()  # a completion ends before the first of these strings it contains
    repetition_penalty: float | None = None  # > 0 (1 = none; module doc); None: the model's, else 1

    def check(self, where: str = "") -> SamplingOptions:
        """Raise a :class:`ConfigError` naming the option (``where``: the file that set it, else its
        flag) for a value outside its range."""
        say = (lambda n: f"{where}: {n}") if where else (lambda n: f"--{_flag(n)}")
        for name in ("max_new_tokens", "top_k", "seed"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{say(name)}: must be >= 0, got {value}")
        if self.seed >= 2**64:  # torch.Generator.manual_seed takes 64 bits
            raise ConfigError(f"{say('seed')}: must be below 2**64 = {2**64}, got {self.seed}")
        t, p, r = self.temperature, self.top_p, self.repetition_penalty
        if t is not None and not (math.isfinite(t) and t >= 0):
            raise ConfigError(f"{say('temperature')}: must be a finite number >= 0 (0 = greedy), got {t}")
        if p is not None and not (0 < p <= 1):
            raise ConfigError(f"{say('top_p')}: must be in (0, 1] (1 = no nucleus cut), got {p}")
        if r is not None and not (math.isfinite(r) and r > 0):
            raise ConfigError(f"{say('repetition_penalty')}: must be a finite number > 0 (1 = none), got {r}")
        if any(not s for s in self.stop):
            raise ConfigError("--stop: an empty stop string would end every completion at once")
        return self

    def greedy_problem(self, given: set[str], where: str) -> str:
        """The line naming an option of ``given`` that greedy decoding (temperature 0, set by
        ``where``) ignores: ``top_k``, ``top_p`` and ``seed`` only shape a draw ("": none given)."""
        ignored = [f"--{_flag(n)}" for n in ("top_k", "top_p", "seed") if n in given]
        if not ignored or self.rule().temperature != 0:
            return ""
        return (
            f"{', '.join(ignored)}: no effect under greedy decoding ({where} = 0: the likeliest token "
            "every step); give --temperature T > 0 to sample"
        )

    def with_defaults(self, model: Mapping[str, float]) -> SamplingOptions:
        """The options, each one left unset taking ``model``'s value (the model's defaults) if it has one."""
        filled: dict[str, Any] = {k: v for k, v in model.items() if k in BUILTIN and getattr(self, k) is None}
        return replace(self, **filled) if filled else self

    def rule(self) -> Rule:
        """The next-token rule: each option, Loom's default (:data:`BUILTIN`) where unset."""
        value = {k: v if (v := getattr(self, k)) is not None else d for k, d in BUILTIN.items()}
        return Rule(
            float(value["temperature"]),
            int(value["top_k"]),
            float(value["top_p"]),
            float(value["repetition_penalty"]),
        )


def _flag(name: str) -> str:
    return name.replace("_", "-")


def read_prompts(path: str | Path, chat: bool) -> list[Prompt]:
    """Prompts of a file: ``.jsonl`` lines holding ``{"prompt": text}`` or (with ``--chat``)
    ``{"messages": [{role, content}, ...]}`` or a JSON string; any other file one prompt per
    non-empty line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"--prompts: {p} is not a file (one prompt per line, or .jsonl records)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompts: {p} is not UTF-8 text ({e})") from None
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts: {p} holds no prompt")
    if p.suffix != ".jsonl":
        return [line for _, line in lines]
    return [_record(json_line(p, i, line), f"{p}:{i}", chat) for i, line in lines]


def json_line(p: Path, i: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--prompts: {p}:{i} is not valid JSON ({e})") from None


def _record(rec: Any, where: str, chat: bool) -> Prompt:
    if isinstance(rec, str):
        return rec
    if isinstance(rec, dict) and "prompt" in rec and "messages" in rec:
        raise ConfigError(
            f"--prompts: {where} holds both 'prompt' and 'messages'; give one of them per record"
        )
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        return rec["prompt"]
    if isinstance(rec, dict) and "messages" in rec:
        msgs = rec["messages"]
        ok = (
            isinstance(msgs, list)
            and msgs
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        )
        if not ok:
            raise ConfigError(
                f"--prompts: {where}: 'messages' must be a non-empty list of {{role, content}} strings"
            )
        if not chat:
            raise ConfigError(
                f"--prompts: {where} holds chat messages; add --chat to render them with the chat template"
            )
        from loom.data.chat import ROLES  # the roles chat data may have: a template renders no other

        unknown = next((m["role"] for m in msgs if m["role"] not in ROLES), None)
        if unknown is not None:
            raise ConfigError(
                f"--prompts: {where} has a message of unknown role {unknown!r} (allowed: {', '.join(ROLES)})"
            )
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    raise ConfigError(
        f"--prompts: {where} is neither a JSON string nor an object with 'prompt' (text) or 'messages'"
    )
