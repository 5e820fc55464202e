"""Names of the architectures and size presets ``make-model`` can write (no heavy imports:
the CLI reads them to build its help)."""

from __future__ import annotations

ARCHS = (
    "llama",
    "qwen3",
    "qwen3_next",
    "granite_hybrid",
    # families with tiny and small presets (models/family_presets.py; the DSA pair a 0.6b one too)
    "qwen2",
    "mistral",
    "llama3",
    "qwen3_moe",
    "qwen3_5",
    "granite_hybrid_moe",
    "glm_moe_dsa",
    "deepseek_v32",
)
# tiny: a whole test in milliseconds; small: the CPU benchmark size; compat: head sizes vLLM's
# CPU kernels accept; 0.6b: Qwen3-0.6B's real shape (qwen3) or a Qwen3-Next-style model of similar
# size (qwen3_next), bfloat16 weights, for GPU numbers comparable with published ones.
PRESETS = ("tiny", "small", "compat", "0.6b")
