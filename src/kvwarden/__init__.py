"""kvwarden: an LLM serving engine whose logits are a pure function of the request's tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvwarden.engine.outputs import RequestOutput
    from kvwarden.engine.sampling_params import SamplingParams
    from kvwarden.engine.structured.params import StructuredOutputsParams
    from kvwarden.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"

# The public names import torch; loading them on first use keeps `kvwarden --help` instant.
_LAZY = {
    "LLM": "kvwarden.llm",
    "RequestOutput": "kvwarden.engine.outputs",
    "SamplingParams": "kvwarden.engine.sampling_params",
    "StructuredOutputsParams": "kvwarden.engine.structured.params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvwarden' has no attribute {name!r}")
