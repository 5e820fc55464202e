"""``<think>…</think>`` apart from the answer (``--reasoning-parser NAME``, vLLM's names): returned as
``reasoning_content`` beside ``content``, and streamed apart.

* ``qwen3`` (also ``glm45``): an answer that opens with ``<think>`` reasons until ``</think>``; one that does
  not has no reasoning (thinking was off: the template closed the block in the prompt).
* ``deepseek_r1``: the template opens the block in the prompt, so the answer reasons until ``</think>``; one
  cut before it is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_in_prompt: bool  # the template opened <think> (deepseek_r1): the answer starts inside the block

    def thinks(self, text: str) -> bool:
        return self.opens_in_prompt or text.lstrip().startswith(START)

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning or None, content)`` of a whole answer."""
        if not self.thinks(text):
            return None, text
        at = text.find(END)
        body = text if at < 0 else text[:at]
        reasoning = body.lstrip().removeprefix(START).strip()
        return reasoning or None, "" if at < 0 else text[at + len(END) :].lstrip("\n")


PARSERS = {
    p.name: p
    for p in (
        ReasoningParser("qwen3", opens_in_prompt=False),
        ReasoningParser("glm45", opens_in_prompt=False),
        ReasoningParser("deepseek_r1", opens_in_prompt=True),
    )
}


class StreamedReasoning:
    """A streamed answer's deltas as ``("reasoning_content" | "content", text)`` pieces: reasoning until
    ``</think>``, content after (a suffix that may begin a marker is held back until it resolves)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.mode = "reasoning" if parser.opens_in_prompt else "undecided"  # then "content"
        self.trim = {"reasoning_content": True, "content": False}  # leading blank lines dropped, as split() does

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.text += delta
        if self.mode == "undecided":
            head = self.text.lstrip()
            if START.startswith(head):  # could still be "<think>": wait
                return []
            self.mode = "reasoning" if head.startswith(START) else "content"
            if self.mode == "reasoning":
                self.sent = self.text.find(START) + len(START)
        if self.mode == "content":
            out, self.sent = self.text[self.sent :], len(self.text)
            return self._pieces(("content", out))
        at = self.text.find(END, self.sent)
        if at >= 0:
            reasoning = self.text[self.sent : at].rstrip()
            self.mode, rest = "content", self.text[at + len(END) :]
            self.trim["content"] = True
            self.sent = len(self.text)
            return self._pieces(("reasoning_content", reasoning), ("content", rest))
        held = _held(self.text, END)
        body = self.text[self.sent : len(self.text) - held]
        keep = held + len(body) - len(body.rstrip())  # blanks that may turn out to precede </think>: held too
        out = self.text[self.sent : len(self.text) - keep]
        self.sent = len(self.text) - keep
        return self._pieces(("reasoning_content", out))

    def _pieces(self, *pieces: tuple[str, str]) -> list[tuple[str, str]]:
        out = []
        for kind, text in pieces:
            if self.trim.get(kind):
                text = text.lstrip()
                self.trim[kind] = not text
            if text:
                out.append((kind, text))
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held back when the answer ends."""
        kind = "reasoning_content" if self.mode == "reasoning" else "content"
        return self._pieces((kind, self.text[self.sent :]))


def _held(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
