"""Stop detection: whether a sequence's newest tokens end it (EOS, a stop string, its length).

Stop strings are looked for in the detokenized output, as vLLM does. Decoding the whole
output after every token costs O(n) per token; instead only the tokens not yet checked are
decoded, with a margin of earlier tokens wide enough for any stop string to straddle the
boundary (a character is at most 4 byte-level tokens, plus one for a leading space), so a
stop string is found at the same token as a full decode would find it.
"""

from shared.engine.sequence import Sequence

MARGIN_TOKENS_PER_CHAR = 4
"""Tokens one character of a stop string may span (UTF-8 bytes, each a byte-level token)."""


class StopDetector:
    """Decides the finish reason of a sequence after tokens were appended to it."""

    def __init__(self, tokenizer, eos_token_ids: frozenset[int] | set[int]):
        self._tokenizer = tokenizer
        self._eos_ids = eos_token_ids

    def finish_reason(self, seq: Sequence) -> str | None:
        """``stop``, ``length`` or None, judged on the sequence's last token and its output text."""
        outputs = seq.output_token_ids
        params = seq.sampling
        if len(outputs) < params.min_tokens:
            return None  # neither EOS nor a stop string ends it yet (vLLM's min_tokens)
        if outputs and outputs[-1] in self._eos_ids and not params.ignore_eos:
            return "stop"
        if params.stop and self._ends_with_stop_string(seq, outputs):
            return "stop"
        if len(outputs) >= params.max_tokens:
            return "length"
        return None

    def _ends_with_stop_string(self, seq: Sequence, outputs: list[int]) -> bool:
        margin = MARGIN_TOKENS_PER_CHAR * max(len(stop) for stop in seq.sampling.stop) + 1
        start = max(0, seq.num_stop_checked_tokens - margin)
        text = self._tokenizer.decode(outputs[start:], skip_special_tokens=True)
        seq.num_stop_checked_tokens = len(outputs)
        return any(stop in text for stop in seq.sampling.stop)
