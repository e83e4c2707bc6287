"""Split GLM model output into text and tags.

The tags are the eight markup tokens of the output format plus the turn/stop tokens the parsers drop.
vLLM streams output as ``(delta_text, delta_token_ids)``. When the ids are there, a tag is a tag only if
the model produced its *token id*: the same characters written with ordinary tokens stay text. Without ids
(non-streaming results and text-only callers) tags are matched on the text, and a trailing piece that may
be the start of a tag is held back until the next chunk decides.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

THINK_START = "<think>"
THINK_END = "</think>"
CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
KEY_START = "<arg_key>"
KEY_END = "</arg_key>"
VALUE_START = "<arg_value>"
VALUE_END = "</arg_value>"
MARKUP = (THINK_START, THINK_END, CALL_START, CALL_END, KEY_START, KEY_END, VALUE_START, VALUE_END)
# Turn and stop tokens: never part of an answer, dropped wherever they show up.
DROPPED = ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>")
TAGS = MARKUP + DROPPED


class Tag(str):
    """A recognised tag (its literal); plain text is a plain ``str``."""


Piece = str  # ``Tag`` or text


def tag_ids(vocab: Mapping[str, int]) -> dict[int, str]:
    """Token id -> tag literal, from the tokenizer's vocabulary. The eight markup tags must all exist."""
    missing = [t for t in MARKUP if t not in vocab]
    if missing:
        raise ValueError(f"the tokenizer has no {missing} tokens: it is not a GLM-4.5/4.7/5.x tokenizer")
    return {vocab[t]: t for t in TAGS if t in vocab}


_TAG_RE = re.compile("|".join(re.escape(t) for t in sorted(TAGS, key=len, reverse=True)))


def _partial_tag_start(text: str) -> int:
    """Where a trailing proper prefix of a tag begins in ``text``, or ``len(text)`` if none does.
    Every tag starts with ``<`` and contains no other ``<``."""
    start = text.rfind("<")
    if start < 0:
        return len(text)
    tail = text[start:]
    return start if any(tag.startswith(tail) and tag != tail for tag in TAGS) else len(text)


class TagLexer:
    """Incremental lexer for one generated turn.

    ``feed`` returns the pieces now certain; ``flush`` returns what is held back (at the end of output).
    Once any chunk carried token ids, tags are recognised by id only ("id mode") for the rest of the turn.
    """

    def __init__(self, ids_to_tags: Mapping[int, str], decode: Callable[[Sequence[int]], str]) -> None:
        self._ids_to_tags = ids_to_tags
        self._decode = decode
        self._id_mode = False
        self._held = ""  # text mode: a possible tag prefix at the end of the last chunk

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[Piece]:
        if token_ids:
            self._id_mode = True
        if self._id_mode:
            held, self._held = self._held, ""
            return ([held] if held else []) + self._by_ids(text, token_ids)
        text, self._held = self._held + text, ""
        cut = _partial_tag_start(text)
        text, self._held = text[:cut], text[cut:]
        return self._by_text(text)

    def flush(self) -> list[Piece]:
        held, self._held = self._held, ""
        return [held] if held else []

    @staticmethod
    def _by_text(text: str) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        for match in _TAG_RE.finditer(text):
            pieces.append(text[pos : match.start()])
            pieces.append(Tag(match.group()))
            pos = match.end()
        pieces.append(text[pos:])
        return _nonempty(pieces)

    def _by_ids(self, text: str, token_ids: Sequence[int]) -> list[Piece]:
        """Locate each tag id's literal in ``text``. The ordinary tokens before it say where it should be;
        if the detokenizer shifted the text (held-back bytes), the next occurrence is taken instead, and a
        tag whose text is absent (``skip_special_tokens``) is placed without consuming any."""
        pieces: list[Piece] = []
        pos = 0
        run_start = 0
        for i, token_id in enumerate(token_ids):
            tag = self._ids_to_tags.get(token_id)
            if tag is None:
                continue
            run = token_ids[run_start:i]
            expected = pos + (len(self._decode(run)) if run else 0)
            if text.startswith(tag, expected):
                cut, width = expected, len(tag)
            elif (found := text.find(tag, pos)) >= 0:
                cut, width = found, len(tag)
            else:
                cut, width = min(expected, len(text)), 0
            pieces.append(text[pos:cut])
            pieces.append(Tag(tag))
            pos = cut + width
            run_start = i + 1
        pieces.append(text[pos:])
        return _nonempty(pieces)


def _nonempty(pieces: list[Piece]) -> list[Piece]:
    return [p for p in pieces if p]
