"""Names of the architectures and size presets ``make-model`` can write (no heavy imports:
the CLI reads them to build its help)."""

from __future__ import annotations

ARCHS = ("llama", "qwen3", "qwen3_next", "granite_hybrid")
# tiny: a whole test in milliseconds; small: the CPU benchmark size; compat: head sizes vLLM's
# CPU kernels accept.
PRESETS = ("tiny", "small", "compat")
