"""The router's incremental detokenizer: the same text as one full decode, in linear time."""

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.detokenizer import Detokenizer

TEXT = "Hello wörld — 日本語 テキスト 🎉🎉, code: def f(x): return x**2\n"
STOPS = ["e", "語", "xx", "\n", "🎉", "return", "ld —"]


class CountingTokenizer:
    """The real tokenizer, counting the tokens every decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.num_decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.num_decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def stream(tokenizer, token_ids: list[int], batch_sizes: list[int], stop: tuple[str, ...]) -> str:
    detok, parts, start = Detokenizer(tokenizer, stop), [], 0
    for size in batch_sizes:
        if start >= len(token_ids) or detok.stopped:
            break
        parts.append(detok.add(token_ids[start : start + size]))
        start += size
    if start < len(token_ids) and not detok.stopped:
        parts.append(detok.add(token_ids[start:]))
    parts.append(detok.flush())
    assert detok.emitted == "".join(parts)
    return "".join(parts)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_streamed_deltas_equal_one_full_decode_cut_at_the_first_stop_string(tiny_metadata, data):
    tokenizer = tiny_metadata.tokenizer
    text_ids = tokenizer.encode(TEXT * 2, add_special_tokens=False)
    token_ids = data.draw(
        st.one_of(
            st.just(text_ids),
            st.lists(st.integers(min_value=0, max_value=len(tokenizer) - 1), max_size=60),
            st.lists(st.integers(min_value=0, max_value=300), max_size=60),  # byte tokens: split characters
            st.builds(lambda a, b: a + b, st.just(text_ids), st.lists(st.sampled_from([0, 1, 2]), max_size=4)),
        )
    )
    batch_sizes = data.draw(st.lists(st.integers(min_value=1, max_value=25), max_size=80))
    stop = tuple(data.draw(st.lists(st.sampled_from(STOPS), max_size=2)))
    expected = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [i for i in (expected.find(s) for s in stop) if i >= 0]
    if cuts:
        expected = expected[: min(cuts)]
    assert stream(tokenizer, token_ids, batch_sizes, stop) == expected


def test_a_long_stream_is_decoded_in_linear_time(tiny_metadata):
    tokenizer = CountingTokenizer(tiny_metadata.tokenizer)
    token_ids = tiny_metadata.tokenizer.encode(TEXT * 200, add_special_tokens=False)
    text = stream(tokenizer, token_ids, [1] * len(token_ids), ("never appears",))
    assert text == tiny_metadata.tokenizer.decode(token_ids, skip_special_tokens=True)
    # Each token is decoded a handful of times (as new, then as context), not once per later token.
    assert tokenizer.num_decoded <= 6 * len(token_ids), (tokenizer.num_decoded, len(token_ids))
