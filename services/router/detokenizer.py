"""Incremental detokenization with stop strings, for streaming text deltas."""


class Detokenizer:
    """Turns a growing list of token IDs into text deltas.

    Holds back a trailing incomplete character and any tail that could still become a stop
    string; text at and after a stop string is never emitted (OpenAI semantics).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Add tokens; return the new text safe to emit."""
        self.token_ids.extend(token_ids)
        text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._advance(text[:cut])
        stable = text.rstrip("\ufffd")
        if self._hold:
            stable = stable[:max(len(self.emitted), len(stable) - self._hold)]
        return self._advance(stable)

    def flush(self) -> str:
        """The held-back rest, at the end of generation."""
        if self.stopped:
            return ""
        text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.emitted):
            return ""  # a re-tokenised prefix changed; never retract emitted text
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta
