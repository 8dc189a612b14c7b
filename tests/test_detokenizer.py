"""The router's incremental detokenizer: the same text as one full decode, in linear time,
through the tokenizer's decode or through each token's bytes; and the per-request template of
its content events."""

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders

from services.router import token_bytes as token_bytes_module
from services.router.detokenizer import Detokenizer
from services.router.openai_api import ParsedRequest, SamplingParams, chunk_body
from services.router.sse_chunks import ContentEvents
from services.router.token_bytes import TokenBytes

TEXT = "Hello wörld — 日本語 テキスト 🎉🎉, code: def f(x): return x**2\n"
STOPS = ["e", "語", "xx", "\n", "🎉", "return", "ld —"]


class CountingTokenizer:
    """The real tokenizer, counting the tokens every decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.num_decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.num_decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def tiny_token_bytes(tiny_metadata) -> TokenBytes:
    token_bytes = TokenBytes.of(tiny_metadata.tokenizer)
    assert token_bytes is not None  # SmolLM2's tokenizer is byte-level BPE
    return token_bytes


def stream(
    tokenizer,
    token_ids: list[int],
    batch_sizes: list[int],
    stop: tuple[str, ...],
    token_bytes: TokenBytes | None = None,
) -> str:
    detok, parts, start = Detokenizer(tokenizer, stop, token_bytes), [], 0
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


@pytest.mark.parametrize("decoder", ["tokenizer", "token-bytes"])
@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_streamed_deltas_equal_one_full_decode_cut_at_the_first_stop_string(
    tiny_metadata, tiny_token_bytes, decoder, data
):
    tokenizer = tiny_metadata.tokenizer
    token_bytes = tiny_token_bytes if decoder == "token-bytes" else None
    text_ids = tokenizer.encode(TEXT * 2, add_special_tokens=False)
    token_ids = data.draw(
        st.one_of(
            st.just(text_ids),
            st.lists(st.integers(min_value=0, max_value=len(tokenizer) + 5), max_size=60),  # past it: skipped
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
    assert stream(tokenizer, token_ids, batch_sizes, stop, token_bytes) == expected


def test_a_long_stream_is_decoded_in_linear_time(tiny_metadata):
    tokenizer = CountingTokenizer(tiny_metadata.tokenizer)
    token_ids = tiny_metadata.tokenizer.encode(TEXT * 200, add_special_tokens=False)
    text = stream(tokenizer, token_ids, [1] * len(token_ids), ("never appears",))
    assert text == tiny_metadata.tokenizer.decode(token_ids, skip_special_tokens=True)
    # Each token is decoded a handful of times (as new, then as context), not once per later token.
    assert tokenizer.num_decoded <= 6 * len(token_ids), (tokenizer.num_decoded, len(token_ids))


def test_token_bytes_refuse_an_id_decode_cannot_take(tiny_token_bytes):
    with pytest.raises(ValueError, match="negative"):
        Detokenizer(None, (), tiny_token_bytes).add([-1])


def test_no_token_bytes_for_a_tokenizer_whose_decode_is_not_the_tables(tiny_metadata, monkeypatch):
    other_decoder = copy.deepcopy(tiny_metadata.tokenizer)
    other_decoder._tokenizer.decoder = decoders.Metaspace()
    assert TokenBytes.of(other_decoder) is None
    cleaning_up = copy.deepcopy(tiny_metadata.tokenizer)
    cleaning_up.clean_up_tokenization_spaces = True
    assert TokenBytes.of(cleaning_up) is None
    # A table that disagrees with the tokenizer on any token (two bytes swapped) is not used.
    chars = token_bytes_module._byte_chars()
    a, b = (c for c, byte in chars.items() if byte in (ord("a"), ord("b")))
    chars[a], chars[b] = chars[b], chars[a]
    monkeypatch.setattr(token_bytes_module, "_byte_chars", lambda: chars)
    assert TokenBytes.of(tiny_metadata.tokenizer) is None


@pytest.mark.parametrize("chat", [True, False])
@given(text=st.text(min_size=1, max_size=40))
def test_a_content_event_is_the_chunk_of_its_text(chat, text):
    req = ParsedRequest(chat, 'm\u00fcdel "x"', [1, 2], SamplingParams(max_tokens=4), system_fingerprint="fp\x00")
    event = ContentEvents(req, "req-\u00e9").event(text)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: ") : -2]) == chunk_body(req, "req-\u00e9", text)
