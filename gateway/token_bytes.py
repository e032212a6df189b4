"""The bytes each token stands for, for the ``bytes`` of chat logprobs.

OpenAI's ``bytes`` lets a client join the pieces of a character that several tokens share:
the tokens' bytes concatenated are the text's UTF-8. Encoding a token's *decoded* string
cannot give that: a token holding half of a character decodes to U+FFFD, whose UTF-8 is
three other bytes. So the bytes come from the vocabulary itself: byte-level BPE tokens (GPT-2,
Llama 3, SmolLM) spell their bytes with GPT-2's printable byte alphabet; SentencePiece
vocabularies with byte fallback (Llama 2, Mistral, Gemma) hold a lone byte as ``<0xNN>`` and
a space as U+2581. Special tokens, and tokenizers of neither kind, give their text's UTF-8.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


class TokenBytes:
    """token id -> bytes for one tokenizer, cached (a vocabulary is at most a few hundred
    thousand entries; only the ids asked for are kept)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = type(getattr(backend, "decoder", None)).__name__
        pre = type(getattr(backend, "pre_tokenizer", None)).__name__
        self._byte_level = "ByteLevel" in (decoder, pre)
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self._special = set(tokenizer.all_special_ids)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # an id past the vocabulary
            return b""
        if token_id in self._special:
            return piece.encode()
        if self._byte_level and all(char in self._byte_of for char in piece):
            return bytes(self._byte_of[char] for char in piece)
        match = _BYTE_PIECE.fullmatch(piece)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        if _SPIECE_SPACE in piece:
            return piece.replace(_SPIECE_SPACE, " ").encode()
        return str(self._tokenizer.decode([token_id])).encode()
