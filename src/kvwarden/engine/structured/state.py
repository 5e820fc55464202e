"""One request's grammar state: which tokens may come next, as a mask over the model's logits.

NOTE(invariance): the mask is a function of the request's tokens so far and
nothing else (the grammar is fixed at admission; the matcher advances only on
tokens the request emits), and applying it is element-wise (``masked_fill``
with ``-inf``), so a row's masked logits are as invariant as its raw logits:
batch partners, chunking, prefix hits, preemption and speculation change
neither. Logprobs stay the model's raw distribution (the mask, like
temperature, only changes which token is chosen).
"""

from __future__ import annotations

from typing import Any

import torch


class GrammarFailure(RuntimeError):
    """A request's grammar cannot go on (no token allowed, or the library's matcher failed): the engine
    ends that request, with this message as its error, and serves the others."""

    code = "structured_output_failed"


class GrammarState:
    """The matcher of one output: advanced by every token the request emits, rolled back after draft checks."""

    def __init__(
        self, matcher: Any, vocab_size: int, eos_token_ids: tuple[int, ...], forbidden: tuple[int, ...] = ()
    ) -> None:
        """Args:
        matcher: the request's own llguidance matcher.
        vocab_size: the width of the logits.
        eos_token_ids: the tokens that end the output (allowed once the grammar is complete).
        forbidden: ids never allowed where an EOS is (special tokens other than EOS: see ``masks``).
        """
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._eos = frozenset(eos_token_ids)
        self._forbidden = list(forbidden)

    def masks(self, drafts: list[int], device: torch.device | str) -> torch.Tensor:
        """Allowed tokens ``[rows, vocab]`` (bool) for the next position and after each draft prefix.

        Row ``i`` is the mask after ``drafts[:i]``: what the grammar allows at the position verify's
        row ``i`` scores. Rows stop at the first draft the grammar refuses (verify never goes past
        it: that draft cannot be chosen) or after an end-of-sequence draft. The matcher is left
        where it was.
        """
        # llguidance's numpy helpers, not its torch ones: those compile TorchScript on import.
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        # Only drafts the grammar accepts are consumed: a refused token would put the matcher in its error
        # state. Nothing follows an end-of-sequence draft (the request stops there).
        valid = self._matcher.validate_tokens(drafts) if drafts else 0
        ends = next((i for i, t in enumerate(drafts[:valid]) if t in self._eos), valid)
        bitmask = allocate_token_bitmask(ends + 1, self.vocab_size)
        fill_next_token_bitmask(self._matcher, bitmask, 0)
        for row, token in enumerate(drafts[:ends], start=1):
            self._consume(token)
            fill_next_token_bitmask(self._matcher, bitmask, row)
        if ends and not self._matcher.rollback(ends):
            raise GrammarFailure(f"structured outputs: rollback failed: {self._matcher.get_error()}")
        allowed = unpack(torch.from_numpy(bitmask), self.vocab_size, device)
        if self._forbidden:
            # Only where the grammar may end: there llguidance can allow the tokenizer's own end-of-text
            # token beside the EOS it was given. A grammar that asks for a special token mid-way keeps it.
            ends = allowed[:, list(self._eos)].any(dim=1)
            allowed[ends.nonzero().flatten().unsqueeze(1), torch.tensor(self._forbidden, device=device)] = False
        if not bool(allowed[0].any()):
            raise GrammarFailure("structured outputs: the grammar allows no token at this point")
        if not self._matcher.is_accepting() and not bool(allowed[0, self._not_eos(device)].any()):
            # llguidance allows only the end of sequence where no text can complete the grammar: ending there
            # would return text the constraint does not accept, so the request ends with this error instead
            raise GrammarFailure("structured outputs: no text can complete the grammar from here")
        return allowed

    def dead_end(self) -> bool:
        """Whether no text can complete the grammar from here (only the end of sequence is allowed, and the
        grammar does not accept what it has): at the start, a constraint whose language is empty."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        bitmask = allocate_token_bitmask(1, self.vocab_size)
        fill_next_token_bitmask(self._matcher, bitmask, 0)
        allowed = unpack(torch.from_numpy(bitmask), self.vocab_size, "cpu")[0]
        return not self._matcher.is_accepting() and not bool(allowed[self._not_eos("cpu")].any())

    def _not_eos(self, device: torch.device | str) -> torch.Tensor:
        keep = torch.ones(self.vocab_size, dtype=torch.bool, device=device)
        keep[list(self._eos)] = False
        return keep

    def mask_after(self, tokens: list[int], device: torch.device | str) -> torch.Tensor | None:
        """The allowed tokens ``[vocab]`` after ``tokens`` (drafts made so far, not emitted), so a proposer
        drafts what the grammar allows; ``None`` if the grammar refuses them (the rest is wasted anyway).
        The matcher is left where it was."""
        if any(t in self._eos for t in tokens) or (tokens and self._matcher.validate_tokens(tokens) != len(tokens)):
            return None
        try:
            return self.masks(tokens, device)[-1]
        except GrammarFailure:  # the step that samples this request will end it; a proposer just stops
            return None

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here (an EOS ends the count)."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def accept(self, token: int) -> None:
        """Advance by an emitted token (one the mask allowed).

        Raises:
            GrammarFailure: the grammar refuses it (a token chosen outside the mask: an engine bug).
        """
        # validate_tokens checks grammar tokens only; an EOS is checked by consuming it (the request ends).
        if token not in self._eos and self._matcher.validate_tokens([token]) != 1:
            raise GrammarFailure(f"structured outputs: token {token} was emitted but the grammar refuses it")
        self._consume(token)

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            reason = self._matcher.get_error()
            raise GrammarFailure(f"structured outputs: the grammar failed on token {token}: {reason}")


def unpack(bitmask: torch.Tensor, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """A packed ``int32 [rows, ceil(vocab / 32)]`` bitmask (bit ``i % 32`` of word ``i // 32`` set = token
    ``i`` allowed) as ``bool [rows, vocab]`` on ``device``."""
    ids = torch.arange(vocab_size, device=device)
    words = bitmask.to(device)[:, ids // 32]
    return ((words >> (ids % 32)) & 1).bool()
