"""kvwarden: an LLM serving engine whose logits are a pure function of the request's tokens."""

from kvwarden.engine.outputs import RequestOutput
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
