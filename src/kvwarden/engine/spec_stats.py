"""Per-request speculative-decoding statistics (SGLang reports them per request; vLLM only in aggregate)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Cumulative acceptance counts of one request.

    Attributes:
        num_drafts: verify steps that carried at least one draft token.
        num_draft_tokens: draft tokens proposed and scored.
        num_accepted_tokens: draft tokens accepted.
        accepted_per_position: accepted count by draft position (0 = first draft token).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def accept_length(self) -> float:
        """Mean tokens emitted per verify step: 1 + accepted / drafts (1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def accept_rate(self) -> float:
        """Accepted / proposed draft tokens (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict[str, float | int]:
        """The fields every API response carries (``spec_decoding``)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accept_length": self.accept_length,
            "accept_rate": self.accept_rate,
        }

    def copy(self) -> SpecStats:
        return SpecStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position)
        )
