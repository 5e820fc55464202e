"""Text shipped inside the package: tokenizer corpus, long documents, questions.

The documents serve as long shared prefixes (demo, probe scenarios, tests);
they were written for this project.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources


@dataclass(frozen=True)
class Document:
    number: int
    title: str
    text: str


def _read(name: str) -> str:
    return resources.files("kvwarden.models").joinpath(f"data/{name}").read_text(encoding="utf-8")


def corpus_text() -> str:
    """Tokenizer-training text."""
    return _read("corpus.txt")


@cache
def documents() -> tuple[Document, ...]:
    """The bundled long documents, in file order."""
    docs: list[Document] = []
    for part in _read("documents.txt").split("### DOC ")[1:]:
        head, _, body = part.partition("\n")
        number, _, title = head.partition(":")
        docs.append(Document(int(number), title.strip(), body.strip()))
    return tuple(docs)


@cache
def questions() -> tuple[str, ...]:
    return tuple(line.strip() for line in _read("questions.txt").splitlines() if line.strip())
