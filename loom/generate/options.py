"""The options of ``loom generate`` and its prompt files, checked without torch (one line per bad value).

Sampling of the next token from logits z (V,): greedy argmax when ``temperature`` = 0; else
z / temperature, then with ``top_k`` = k > 0 only the k largest, then with ``top_p`` = p < 1 only
the smallest set of most probable tokens whose probabilities sum to >= p (nucleus), then one draw
from the softmax of what is left with the prompt's own generator seeded by ``seed`` (so a prompt
gives the same text alone or in a batch).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.config import ConfigError

Prompt = str | list[dict[str, str]]  # text, or chat messages [{role, content}, ...]


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int = 200  # tokens generated per prompt at most (unset: at most model.max_seq_len)
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 50  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # nucleus: keep the most likely tokens up to this probability mass (1 = all)
    seed: int = 0  # seed of each prompt's generator
    stop: tuple[str, ...] = ()  # a completion ends before the first of these strings it contains

    def check(self) -> SamplingOptions:
        """Raise a :class:`ConfigError` naming the option for a value outside its range."""
        for name in ("max_new_tokens", "top_k", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_flag(name)}: must be >= 0, got {getattr(self, name)}")
        if self.seed >= 2**64:  # torch.Generator.manual_seed takes 64 bits
            raise ConfigError(f"--seed: must be below 2**64 = {2**64}, got {self.seed}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(
                f"--temperature: must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"--top-p: must be in (0, 1] (1 = no nucleus cut), got {self.top_p}")
        if any(not s for s in self.stop):
            raise ConfigError("--stop: an empty stop string would end every completion at once")
        return self


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
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    raise ConfigError(
        f"--prompts: {where} is neither a JSON string nor an object with 'prompt' (text) or 'messages'"
    )
