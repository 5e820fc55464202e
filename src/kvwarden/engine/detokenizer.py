"""Incremental detokenization: a request's text after each new token without decoding its whole output.

Decoding every output token list in full each step costs O(n) per token, O(n^2) per request: 0.25 ms a
request a step at 1,024 output tokens, 1.3 ms at 8,192 (the bundled tokenizer, one core), which at batch
64 is more than a GPU decode step. Here each step decodes a short window instead: the tokens from
``prefix_offset`` on, beside the same window without the newest tokens (``prefix_offset`` to
``read_offset``); what the newest tokens add is the difference. The window always starts one emission
back, so a tokenizer that treats a window's first token specially (SentencePiece's leading space) does
so on both sides of the difference alike.

NOTE: the text is the one a full decode gives, which streams already rely on (``server/formatting.py``
sends text as a growing prefix). That needs a decoder whose output is local: byte-level BPE (every
made checkpoint, GGUF), Metaspace, WordPiece, BPE suffixes, replacements (``Tokenizer.local_decode``).
Byte-fallback decoders (Llama-2, Mistral and Gemma style ``tokenizer.json``) are not: a run of byte
tokens that turns invalid replaces its earlier, valid bytes as well, so their requests decode in
full every step, exact at the old price. A window whose text does not start with its prefix's (a
decoder that is not local after all) switches its request to full decodes for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvwarden.models.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # an incomplete UTF-8 sequence: more tokens may complete it


@dataclass
class IncrementalText:
    """One request's detokenization state.

    Attributes:
        committed: the text of ``ids[:read_offset]``, final (no trailing incomplete character).
        prefix_offset: where the decoded window starts (one emission back: context for the new tokens).
        read_offset: the tokens before it are in ``committed``.
        full: decode everything each time (a tokenizer whose decode was seen not to be local).
    """

    committed: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    full: bool = False

    def update(self, tokenizer: Tokenizer, ids: list[int], skip: bool) -> str:
        """The text of ``ids`` (the request's output so far, extended since the last call); ``skip``:
        the request's ``skip_special_tokens``."""
        if self.full or not tokenizer.local_decode:
            return tokenizer.decode(ids, skip_special_tokens=skip)
        prefix = ""
        if self.read_offset > self.prefix_offset:
            prefix = tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        window = tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=skip)
        if not window.startswith(prefix):
            self.full = True
            return tokenizer.decode(ids, skip_special_tokens=skip)
        tail = window[len(prefix) :]
        if tail and not tail.endswith(REPLACEMENT):
            # Complete characters: commit them and move the window on.
            self.committed += tail
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return self.committed
        # Nothing yet, or an incomplete character at the end (shown, as a full decode shows it, but not
        # committed: the next token may complete it): the window grows until the text settles.
        return self.committed + tail
