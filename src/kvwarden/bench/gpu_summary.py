"""The summary lines of a ``kvwarden bench gpu`` result (``kvwarden bench --summarize``): one per part
the run has (offline, decode and TTFT rows per engine, MTP, online, shared prefixes, skipped parts)."""

from __future__ import annotations

from typing import Any


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary, for each part the run has."""
    out: list[tuple[str, str]] = []
    if "offline" in figures:
        tok_s: dict[str, dict[str, int]] = {}
        for r in figures["offline"]["rows"] + figures.get("offline_hybrid", []):
            tok_s.setdefault(r.get("model", "dense").split(":")[-1], {})[r["engine"]] = round(r["output_tok_s"])
        out.append(
            ("offline tok/s (model: engine: tok/s), floor", f"{tok_s} {round(figures['offline']['floor_tok_s'])}")
        )
    decode, ttft = figures.get("decode", []), figures.get("ttft", [])
    for engine in dict.fromkeys(r["engine"] for r in decode):
        out.append((f"decode {engine} tok/s (model: by batch)", str(_by_model(decode, engine, "decode_tok_s"))))
    for engine in dict.fromkeys(r["engine"] for r in ttft):
        out.append((f"TTFT {engine} cold/warm s (model: by prompt)", str(_by_model(ttft, engine, "cold_s", "warm_s"))))
    if "spec" in figures:
        spec = [(r["batch"], round(r["off_tok_s"]), round(r["on_tok_s"]), round(r["accept_length"], 2), r["identical"])
                for r in figures["spec"]]  # fmt: skip
        out.append(("MTP k=2 (b: off/on tok/s, accept, equal)", str(spec)))
    if "online" in figures:
        online = [(r["concurrency"], r["engine"][:4], round(r["output_tok_s"]), round(r["tpot_ms_mean"] or 0, 2))
                  for r in figures["online"]]  # fmt: skip
        out.append(("online (c, engine, tok/s, TPOT ms)", str(online)))
    if "shared" in figures:
        shared = [(r["engine"][:4], r["workload"], round(r["output_tok_s"]), round(r["cached_share"], 2))
                  for r in figures["shared"]]  # fmt: skip
        out.append(("shared (engine, workload, tok/s, cached share)", str(shared)))
    if "skipped" in figures:
        out.append(("parts skipped past the deadline", str(figures["skipped"] or "none")))
    return out


def _by_model(rows: list[dict[str, Any]], engine: str, *keys: str) -> dict[str, list[Any]]:
    """One engine's figure (decode tok/s; TTFT cold and warm s) per model, in the rows' order."""
    out: dict[str, list[Any]] = {}
    for r in rows:
        if r["engine"] == engine:
            got = round(r[keys[0]]) if len(keys) == 1 else (round(r[keys[0]], 3), round(r[keys[1]], 4))
            out.setdefault(r["model"].split(":")[-1], []).append(got)
    return out
