"""text_offset of the completions API's logprobs: where each token's text begins in the
choice's text, as vLLM reports it."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer


class TextOffsets:
    """The offsets of a run of tokens whose text starts at ``start`` of the choice's text.

    A token's text is what it adds to the decoded text: a token that holds part of a
    character (one byte of an emoji's four) adds nothing until the token that completes the
    character, which adds it whole. So every offset indexes the text, and the text between
    two offsets is what the tokens between them spell; counting each token's own decoded
    string instead ("\\ufffd" for each part) would shift every later offset."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool,
                 start: int = 0) -> None:
        self._decoded = IncrementalDetokenizer(tokenizer, (), skip_special_tokens)
        self._start = start

    def take(self, token_ids: list[int]) -> list[int]:
        """The offsets of these tokens, the next ones of the run."""
        offsets = []
        for token_id in token_ids:
            offsets.append(self._start + len(self._decoded.text))
            self._decoded.add_tokens([token_id])
        return offsets
