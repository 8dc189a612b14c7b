"""Stop detection decodes only what it has not checked, yet stops where a full decode would."""

import random

from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.engine.stop_detector import StopDetector


def first_stop_by_full_decode(tokenizer, outputs: list[int], stops: tuple[str, ...], min_tokens: int) -> int | None:
    """The reference rule: after each token, decode the whole output and look for a stop."""
    for n in range(max(1, min_tokens), len(outputs) + 1):
        if any(stop in tokenizer.decode(outputs[:n], skip_special_tokens=True) for stop in stops):
            return n
    return None


def first_stop_by_detector(tokenizer, outputs: list[int], stops: tuple[str, ...], min_tokens: int) -> int | None:
    detector = StopDetector(tokenizer, eos_token_ids=frozenset())
    seq = Sequence(
        "r", [1, 2, 3], 3, SamplingParams(max_tokens=len(outputs) + 1, stop=stops, min_tokens=min_tokens), seed=0
    )
    for n, token in enumerate(outputs, start=1):
        seq.token_ids.append(token)
        if detector.finish_reason(seq) == "stop":
            return n
    return None


def test_stop_strings_are_found_at_the_same_token_as_a_full_decode(tiny):
    tokenizer = tiny.tokenizer
    rng = random.Random(3)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dogs,",
        "naïve",
        "café",
        "—",
        "東京",
        "☃",
        "end.",
        "END",
    ]
    for trial in range(40):
        text = " ".join(rng.choice(words) for _ in range(40))
        outputs = tokenizer.encode(text)
        decoded = tokenizer.decode(outputs, skip_special_tokens=True)
        start = rng.randrange(len(decoded) - 6)
        stops = (decoded[start : start + rng.randint(1, 6)], "never-there")
        min_tokens = rng.choice([0, 0, 5, 20])
        assert first_stop_by_detector(tokenizer, outputs, stops, min_tokens) == first_stop_by_full_decode(
            tokenizer, outputs, stops, min_tokens
        ), (trial, stops)


def test_eos_and_length_end_a_sequence_and_min_tokens_holds_both_off(tiny):
    eos = next(iter(tiny.eos_token_ids))
    detector = StopDetector(tiny.tokenizer, tiny.eos_token_ids)
    seq = Sequence("r", [1], 1, SamplingParams(max_tokens=3, min_tokens=2), seed=0)
    seq.token_ids.append(eos)
    assert detector.finish_reason(seq) is None  # below min_tokens
    seq.token_ids.append(eos)
    assert detector.finish_reason(seq) == "stop"
    ignoring = Sequence("r", [1], 1, SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    ignoring.token_ids.extend([eos, eos])
    assert detector.finish_reason(ignoring) == "length"
