"""Incremental detokenization with stop strings, for streaming text deltas."""

import codecs

from services.router.token_bytes import TokenBytes, rust_tokenizer

REPLACEMENT_CHAR = "\ufffd"


def fast_decode(tokenizer):
    """``decode(ids) -> str`` equal to ``tokenizer.decode(ids, skip_special_tokens=True)``: the
    Rust tokenizer's own decode when the HF wrapper would add nothing to it (a fast tokenizer
    that does not clean up spaces), which skips the wrapper's per-call overhead (~2 µs)."""
    backend = rust_tokenizer(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class WindowDecoder:
    """New text of a growing token list through the tokenizer's decode, for any tokenizer.

    Each call decodes only the previous batch (as context: a token's text may depend on its
    neighbours) and the new tokens, so a long stream costs O(new tokens) per batch. A trailing
    incomplete character is held back unless ``final``; the window moves on at every clean
    boundary, so it spans the last batches only (it grows while batches keep ending inside a
    character: at most 3 tokens for UTF-8 text).
    """

    def __init__(self, tokenizer):
        self._decode = fast_decode(tokenizer)
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # the decode window starts here: [prefix, read) is context
        self._read_offset = 0  # tokens past this are new since the last clean boundary
        self._num_window_chars = 0  # chars of the window's text passed on already (past the context)

    def decode(self, token_ids: list[int], final: bool) -> str:
        self.token_ids.extend(token_ids)
        decode = self._decode
        context = decode(self.token_ids[self._prefix_offset : self._read_offset])
        text = decode(self.token_ids[self._prefix_offset :])
        incomplete = text.endswith(REPLACEMENT_CHAR) and not final
        stable = text.rstrip(REPLACEMENT_CHAR) if incomplete else text
        start = len(context) + self._num_window_chars
        new = stable[start:]
        if incomplete:
            self._num_window_chars += len(new)
        else:
            self._prefix_offset, self._read_offset, self._num_window_chars = self._read_offset, len(self.token_ids), 0
        return new


class ByteDecoder:
    """New text of a growing token list from each token's bytes (``TokenBytes``) and an
    incremental UTF-8 decoder: one table lookup per token, no tokenizer call. A trailing
    incomplete character waits in the UTF-8 decoder unless ``final``."""

    def __init__(self, token_bytes: TokenBytes):
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, token_ids: list[int], final: bool) -> str:
        return self._utf8.decode(self._bytes.join(token_ids), final)


class Detokenizer:
    """Turns a growing list of token IDs into text deltas, in time linear in the tokens.

    Decodes through ``token_bytes`` when the tokenizer has such a table (``TokenBytes.of``),
    else through the tokenizer's decode (``WindowDecoder``). Holds back a trailing incomplete
    character and any tail that could still become a stop string; text at and after a stop
    string is never emitted (OpenAI semantics). The concatenated deltas plus ``flush()`` equal
    ``tokenizer.decode(all tokens)`` cut at the first stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), token_bytes: TokenBytes | None = None):
        self._decoder = ByteDecoder(token_bytes) if token_bytes is not None else WindowDecoder(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""  # decoded, not emitted yet (a possible stop string's start)
        self._emitted: list[str] = []
        self.stopped = False

    @property
    def emitted(self) -> str:
        """The text emitted so far."""
        return "".join(self._emitted)

    def add(self, token_ids: list[int]) -> str:
        """Add tokens; return the new text safe to emit."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(token_ids, final=False)
        if not self._stop:
            return self._emit(self._pending)
        cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(self._pending[:cut])
        return self._emit(self._pending[: max(0, len(self._pending) - self._hold)])

    def flush(self) -> str:
        """The held-back rest, at the end of generation."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode([], final=True)
        return self._emit(self._pending)

    def _emit(self, text: str) -> str:
        self._pending = self._pending[len(text) :]
        if text:
            self._emitted.append(text)
        return text
