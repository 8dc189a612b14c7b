"""Each token's bytes, for tokenizers whose decode is "join the tokens' bytes, then UTF-8".

A byte-level BPE tokenizer (GPT-2's scheme: SmolLM2, Llama 3, Qwen, ...) decodes a list of
token ids by concatenating each token's bytes and decoding the result as UTF-8, an invalid
sequence becoming U+FFFD. With each token's bytes in a table, a stream's text can be decoded
incrementally (``codecs`` UTF-8 decoder) with one table lookup per token instead of calls into
the tokenizer. The table is used only where the tokenizer's own decode agrees with it on every
token of the vocabulary (checked when it is built); otherwise ``TokenBytes.of`` gives None.
"""


def _byte_chars() -> dict[str, int]:
    """The byte-level alphabet: the character standing for each byte in a token's string.

    Printable Latin-1 bytes stand for themselves; every other byte ``b`` is the character
    ``256 + n``, where ``n`` counts the non-printable bytes before it.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, num_shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + num_shifted)] = byte
            num_shifted += 1
    return chars


def rust_tokenizer(tokenizer):
    """The Rust tokenizer under an HF fast tokenizer whose ``decode(ids, skip_special_tokens=True)``
    is that tokenizer's own (the wrapper adds nothing: it does not clean up spaces), or None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


class TokenBytes:
    """Token id → the bytes the tokenizer's decode gives it (``b""`` for a special token, which
    ``skip_special_tokens`` drops, and for an id past the vocabulary, which decode skips)."""

    def __init__(self, table: list[bytes]):
        self._table = table

    @classmethod
    def of(cls, tokenizer) -> "TokenBytes | None":
        """The table of a fast byte-level tokenizer whose ``decode(ids, skip_special_tokens=True)``
        is the Rust decoder's and matches the table on every token id; else None."""
        backend = rust_tokenizer(tokenizer)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":
            return None
        special = {token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special}
        chars = _byte_chars()
        to_latin1 = str.maketrans({c: chr(byte) for c, byte in chars.items()})
        table = []
        for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
            token = backend.id_to_token(token_id)
            if token is None or token_id in special:
                table.append(b"")
            elif all(c in chars for c in token):
                table.append(token.translate(to_latin1).encode("latin-1"))
            else:
                table.append(token.encode())  # the decoder keeps a token it cannot map as it is
        token_bytes = cls(table)
        return token_bytes if token_bytes._agrees_with(backend) else None

    def _agrees_with(self, backend) -> bool:
        """Every token, and one id past the vocabulary, decodes as the tokenizer decodes it."""
        for token_id in range(len(self._table) + 1):
            if backend.decode([token_id], skip_special_tokens=True) != self.join([token_id]).decode(errors="replace"):
                return False
        return True

    def join(self, token_ids: list[int]) -> bytes:
        """The bytes of ``token_ids``, in order."""
        table, size = self._table, len(self._table)
        if len(token_ids) == 1 and 0 <= (token_id := token_ids[0]) < size:
            return table[token_id]
        parts = []
        for token_id in token_ids:
            if token_id < 0:
                raise ValueError(f"token id {token_id} is negative")
            parts.append(table[token_id] if token_id < size else b"")
        return b"".join(parts)
