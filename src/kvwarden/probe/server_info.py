"""What a server really runs with, asked from the server rather than assumed.

The predictor's arithmetic depends on the server's KV block size and step
budget, and engines do not always use the values they were given: vLLM raises a
hybrid model's block size until an attention page holds a recurrent-state page,
and the result depends on the machine (160 tokens on one CPU, 288 on another for
the same checkpoint), while its default step budget follows the device's memory.
So every probed server is asked, in this order of trust:

1. the engine's own startup log, where it announces a value it changed;
2. its ``/metrics`` info gauges (``vllm:cache_config_info``,
   ``kvwarden:cache_config_info`` and ``kvwarden:scheduler_config_info``);
3. what the launcher requested (recorded as such, so a reader knows it is an
   assumption, not an observation).

Every value carries its source; the probe records the result per arm
(``server_info`` records in ``records.jsonl``) and prints it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# vLLM (platforms/interface.py) announces the hybrid block size it picked with this line.
_VLLM_BLOCK_LOG = re.compile(r"Setting attention block size to (\d+) tokens")
_INFO_GAUGES = ("vllm:cache_config_info", "kvwarden:cache_config_info", "kvwarden:scheduler_config_info")


@dataclass
class ServerInfo:
    """Facts about one running server, each with where it came from.

    Attributes:
        block_size: tokens per KV block (``None``: the engine has no block cache
            the predictor can model, e.g. llama.cpp's per-slot prompt cache).
        block_size_source: ``"log"``, ``"metrics"`` or ``"requested"``.
        max_num_batched_tokens: the step budget, where known.
        budget_source: as ``block_size_source``.
        labels: every label of the engine's config info gauges (strings).
        extra: engine-specific facts (llama.cpp's ``/props``, versions).
    """

    block_size: int | None = None
    block_size_source: str | None = None
    max_num_batched_tokens: int | None = None
    budget_source: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for the terminal, e.g. ``block size 160 (log), budget 2048 (requested)``."""
        parts = []
        if self.block_size is not None:
            parts.append(f"block size {self.block_size} ({self.block_size_source})")
        if self.max_num_batched_tokens is not None:
            parts.append(f"budget {self.max_num_batched_tokens} ({self.budget_source})")
        parts += [f"{k} {v}" for k, v in self.extra.items() if isinstance(v, (int, str)) and len(str(v)) < 40]
        return ", ".join(parts) or "nothing reported"


def info_labels(metrics_text: str) -> dict[str, str]:
    """Labels of the config info gauges in a Prometheus exposition (merged; empty if none)."""
    labels: dict[str, str] = {}
    try:
        families = list(text_string_to_metric_families(metrics_text))
    except ValueError:
        return labels
    for family in families:
        for sample in family.samples:
            if sample.name in _INFO_GAUGES:
                labels.update(sample.labels)
    return labels


def vllm_log_block_size(log_text: str) -> int | None:
    """The block size vLLM announced it raised to, if it did (the last announcement wins)."""
    found = _VLLM_BLOCK_LOG.findall(log_text)
    return int(found[-1]) if found else None


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


def fetch_labels(url: str, http: httpx.Client | None = None) -> dict[str, str]:
    """Config info labels from ``url/metrics`` (empty if the server has none or no /metrics)."""
    try:
        resp = (http or httpx).get(f"{url.rstrip('/')}/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    return info_labels(resp.text) if resp.status_code == 200 else {}


def discover(
    url: str,
    log_path: Path | None = None,
    requested_block_size: int | None = None,
    requested_budget: int | None = None,
) -> ServerInfo:
    """Block size and budget of a running server: log, then metrics, then what was requested."""
    labels = fetch_labels(url)
    info = ServerInfo(labels=labels)
    log_text = log_path.read_text(errors="replace") if log_path is not None and log_path.is_file() else ""
    candidates = (
        ("log", vllm_log_block_size(log_text)),
        ("metrics", _int(labels.get("block_size"))),
        ("requested", requested_block_size),
    )
    for source, value in candidates:
        if value is not None:
            info.block_size, info.block_size_source = value, source
            break
    for source, value in (("metrics", _int(labels.get("max_num_batched_tokens"))), ("requested", requested_budget)):
        if value is not None:
            info.max_num_batched_tokens, info.budget_source = value, source
            break
    return info
