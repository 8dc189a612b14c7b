"""Log-probabilities in OpenAI's two response shapes (chat and completions).

A token's text is what it decodes to alone; its ``bytes`` are its raw bytes (a byte-level
BPE token may hold part of a UTF-8 character, whose text alone is U+FFFD).
"""

from functools import lru_cache

from shared.engine.logprobs import TokenLogprobs


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character each byte is spelled with → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class LogprobsFormatter:
    """Turns token ids and their ``TokenLogprobs`` into OpenAI's ``logprobs`` objects."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        """The token's text alone."""
        return self._tokenizer.decode([token_id])

    def bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes."""
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if isinstance(piece, str) and piece and all(c in decoder for c in piece):
            return [decoder[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))

    def chat(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict:
        """``choices[].logprobs`` of a chat completion (or of one chunk's tokens)."""
        return {"content": [self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs)], "refusal": None}

    def _chat_entry(self, token_id: int, logprobs: TokenLogprobs | None) -> dict:
        entry = self._alternative(token_id, logprobs.logprob if logprobs else None)
        top = zip(logprobs.top_token_ids, logprobs.top_logprobs) if logprobs else ()
        entry["top_logprobs"] = [self._alternative(t, lp) for t, lp in top]
        return entry

    def _alternative(self, token_id: int, logprob: float | None) -> dict:
        return {"token": self.text(token_id), "logprob": logprob, "bytes": self.bytes(token_id)}

    def completion(self, token_ids: list[int], logprobs: list[TokenLogprobs | None], text_offset: int = 0) -> dict:
        """``choices[].logprobs`` of a text completion; offsets count from ``text_offset``."""
        texts = [self.text(t) for t in token_ids]
        offsets, at = [], text_offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp.logprob if lp else None for lp in logprobs],
            "top_logprobs": [
                {self.text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)} if lp else None for lp in logprobs
            ],
            "text_offset": offsets,
        }
