"""Text a tokenizer will see: what one request may send so that it cannot fail a shared batch.

Checked in the Ingress, before queueing: text the tokenizers cannot take (a lone surrogate:
the Rust tokenizers raise on it, which would fail every request of the batch), control
characters other than tab, newline and carriage return, and the model's own special-token
strings (``</s>``, ``<|endoftext|>``: they would end or pad the text where the user did not
mean to). Lengths are bounded by ``limits.max_prompt_chars`` before these checks run.
"""

from __future__ import annotations

import difflib
import unicodedata

ALLOWED_CONTROL = frozenset("\t\n\r")


def shown(value, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that echo input; a cut
    one says how long the input was (a string's characters, not its ``repr``'s)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, str):
        return text[:limit] + f"...' ({len(value)} characters)"
    return text[:limit] + f"... ({len(text)} characters as written)"


def did_you_mean(key, known) -> str:
    """``" (did you mean 'x'?)"`` for the name of ``known`` nearest ``key`` (difflib's
    ``get_close_matches``, ratio >= 0.6), else ``""``: for errors that refuse an unknown key."""
    close = difflib.get_close_matches(str(key)[:200], [str(k) for k in known], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def text_problem(field: str, value: str, special_tokens: tuple[str, ...] = ()) -> str | None:
    """Why ``value`` (of request field ``field``) cannot go to the tokenizers, or None."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"{field} is not valid Unicode text: a lone surrogate {value[exc.start]!r} at position "
                f"{exc.start}")
    for i, ch in enumerate(value):
        if ch not in ALLOWED_CONTROL and unicodedata.category(ch) == "Cc":
            return (f"{field} contains the control character {ch!r} at position {i}; only tab, newline and "
                    "carriage return are allowed")
    for token in special_tokens:
        if token in value:
            return f"{field} contains {token!r}, a special token of the model's tokenizers; remove it"
    return None
