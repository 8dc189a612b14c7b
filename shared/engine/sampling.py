"""Sampling parameters and the sampler.

Seeded sampling draws token ``i`` of a request from a generator seeded by
``(seed, i)`` alone. Which instance samples a token (relay or main decoder) therefore
never changes the output: a handoff is invisible in sampled text as well as in greedy text.
"""

import msgspec

from shared.errors import InvalidSampling

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per token (vLLM's default ``max_logprobs``)."""
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 2.0
"""A temperature is 0 (greedy) or in this range (vLLM raises smaller ones to 0.01): logits
divided by it stay finite in fp32."""
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 2.0
"""A repetition penalty divides positive logits: at most a factor of 100."""
MAX_ABS_PENALTY = 2.0
"""Frequency and presence penalties lie in ``[-2, 2]`` (OpenAI's range)."""
MAX_TOP_K = 2**31 - 1
"""``top_k`` past the vocabulary means "all tokens"; larger values are refused, not wrapped."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one request picks its tokens and when it stops.

    Attributes:
        max_tokens: Upper bound on generated tokens (the first token counts).
        temperature: 0 for greedy; otherwise logits are divided by it before softmax.
        top_p: Nucleus sampling mass in (0, 1]; 1 disables it.
        seed: Per-request seed for reproducible sampling; None lets the engine pick one.
        stop: Strings that end generation once they appear in the generated text.
        ignore_eos: Keep generating past end-of-sequence tokens (benchmarks).
        top_k: Sample among the ``top_k`` most likely tokens only; 0 disables it.
        min_tokens: End-of-sequence tokens and stop strings do not end the request before
            this many tokens (vLLM's semantics).
        repetition_penalty: >1 discourages every token already in the prompt or the output
            (positive logits divided, negative ones multiplied); 1 disables it.
        frequency_penalty: Subtracted from a token's logit once per time it is in the output.
        presence_penalty: Subtracted from a token's logit if it is in the output at all.
        logprobs: None for no log-probabilities; otherwise each output token carries its own
            log-probability and this many most likely alternatives (0 to ``MAX_LOGPROBS``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None

    def validate(self):
        """Raise ``InvalidSampling`` naming the first field out of range (NaN is out of every range)."""
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(
            self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {self.temperature}",
        )
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            len(self.stop) <= MAX_STOP_STRINGS and all(self.stop),
            "stop",
            f"takes up to {MAX_STOP_STRINGS} non-empty strings",
        )
        _check(0 <= self.top_k <= MAX_TOP_K, "top_k", f"must be in [0, {MAX_TOP_K}], got {self.top_k}")
        _check(
            0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}"
        )
        _check(
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(
                -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY,
                name,
                f"must be in [{-MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {value}",
            )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )

    @property
    def greedy(self) -> bool:
        """True when sampling is deterministic argmax."""
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """True when a penalty changes the logits before sampling."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _check(holds: bool, field: str, message: str):
    # Comparisons with NaN are False, so a NaN fails every check.
    if not holds:
        raise InvalidSampling(field, f"{field} {message}")
