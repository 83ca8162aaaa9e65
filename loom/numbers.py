"""Whole numbers written as text (environment variables, layout lines, TOML keys, file names)."""

from __future__ import annotations


def is_whole(text: str) -> bool:
    """Whether ``text`` is a whole number >= 0 in ASCII digits, so ``int(text)`` reads it: ``str.isdigit``
    also takes superscripts and other scripts' digits ('²', '٣'), which ``int`` refuses or a C library
    reading the same variable would."""
    return text.isascii() and text.isdigit()
