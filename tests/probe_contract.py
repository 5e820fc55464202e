"""What the probe must do whatever the engine does, checked against its own raw records.

A probe run is trustworthy when everything it reports can be recomputed from
``records.jsonl``: fingerprints from the stored top-k lists, each arm's
N/N identical count, stability and first divergent token, the cross-arm
comparison, and the exit status (0 all stable, 1 some arm unstable, 2 some arm
could not run). These checks never look at whether the engine was stable: for
another engine that is a measurement (see ``measure`` in ``conftest.py``).
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

from kvwarden.probe.fingerprint import fingerprint
from kvwarden.probe.suite import answer_key, is_correct, parse_answer


def _exact(tops: list[list[list[Any]]]) -> list[list[tuple[Any, bytes]]]:
    return [[(k, struct.pack("<d", float(v))) for k, v in top] for top in tops]


def _first_divergence(base: list, other: list) -> int | None:
    a, b = _exact(base), _exact(other)
    for i in range(min(len(a), len(b))):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_run(run_dir: Path, code: int, summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Assert the probe's summary and exit status follow from its raw records.

    Returns, per arm, the facts recomputed here (what a measurement records).
    """
    lines = (run_dir / "records.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    assert json.loads((run_dir / "summary.json").read_text()) == summary, "summary.json differs from the printed one"
    facts: dict[str, dict[str, Any]] = {}
    for arm in summary["arms"]:
        name = arm["arm"]
        ends = [r for r in records if r.get("arm") == name and r["type"] in ("arm_done", "arm_error")]
        assert ends, f"{name}: the arm neither finished nor recorded an error"
        last = ends[-1]
        if last["type"] == "arm_error":
            assert arm["error"] and last["error"] in arm["error"], f"{name}: error not reported: {arm}"
            facts[name] = {"error": last["error"].splitlines()[0][:200]}
            continue
        attempt = last["attempt"]
        assert any(r["type"] == "server_info" and r["attempt"] == attempt for r in records), f"{name}: no server_info"
        runs = [r for r in records if r["type"] == "response" and r["attempt"] == attempt and r["measured"]]
        assert runs and arm["runs"] == len(runs), f"{name}: {arm['runs']} runs reported, {len(runs)} recorded"
        for r in runs:
            fp = fingerprint([[(k, v) for k, v in top] for top in r["tops"]], r["text"])
            assert (r["fingerprint"], r["fingerprint_sorted"], r["text_sha256"]) == (fp.ordered, fp.sorted, fp.text)
            assert len(r["tops"]) == len(r["tokens"]), f"{name}: one top-k list per generated token"
        fps = [r["fingerprint"] for r in runs]
        firsts = [d for r in runs[1:] if (d := _first_divergence(runs[0]["tops"], r["tops"])) is not None]
        recomputed = {
            "identical": Counter(fps).most_common(1)[0][1],
            "identical_sorted": Counter(r["fingerprint_sorted"] for r in runs).most_common(1)[0][1],
            "stable": len(set(fps)) == 1,
            "first_divergent_token": min(firsts) if firsts else None,
            "cached_tokens": [r["cached_tokens"] for r in runs],
            "texts_identical": len({r["text_sha256"] for r in runs}) == 1,
            "fingerprints": fps,
        }
        for key, value in recomputed.items():
            assert arm[key] == value, f"{name}.{key}: reported {arm[key]!r}, records say {value!r}"
        facts[name] = {k: v for k, v in recomputed.items() if k != "fingerprints"} | {"runs": len(runs)}
    by = {a["arm"]: a for a in summary["arms"]}
    compare = json.loads((run_dir / "scenario.json").read_text())["compare_arms"]
    if compare and by[compare[0]]["fingerprints"]:
        ref = by[compare[0]]["fingerprints"][0]
        expected_cross = {n: bool(by[n]["fingerprints"]) and by[n]["fingerprints"][0] == ref for n in compare[1:]}
        assert summary["cross_arm"] == expected_cross, f"cross-arm {summary['cross_arm']}, records say {expected_cross}"
    arms = summary["arms"]
    expected = 2 if any(a["error"] for a in arms) else (0 if all(a["stable"] for a in arms) else 1)
    assert code == expected, f"exit status {code}, the records call for {expected}"
    return facts


def check_suite_run(run_dir: Path, code: int, brief: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Assert a ``probe --suite`` run's summary and exit status follow from its raw records: per task, the
    runs' fingerprints, parsed answers and correctness are recomputed here from the stored text and tops.

    Returns, per arm, its counts (what a measurement records).
    """
    lines = (run_dir / "records.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    tasks = {t["id"]: t for t in map(json.loads, (run_dir / "tasks.jsonl").read_text().splitlines())}
    assert brief["arms"] == [{k: v for k, v in a.items() if k != "per_task"} for a in summary["arms"]]
    facts: dict[str, dict[str, Any]] = {}
    for arm in summary["arms"]:
        name = arm["arm"]
        ends = [r for r in records if r.get("arm") == name and r["type"] in ("arm_done", "arm_error")]
        assert ends, f"{name}: the arm neither finished nor recorded an error"
        if ends[-1]["type"] == "arm_error":
            assert arm["error"] and ends[-1]["error"] in arm["error"], f"{name}: error not reported: {arm}"
            facts[name] = {"error": ends[-1]["error"].splitlines()[0][:200]}
            continue
        runs = [r for r in records if r["type"] == "response" and r["attempt"] == ends[-1]["attempt"]]
        assert len(arm["per_task"]) == len(tasks), f"{name}: {len(arm['per_task'])} tasks reported"
        for row in arm["per_task"]:
            mine = [r for r in runs if r["task"] == row["task"]]
            assert mine and row["runs"] == len(mine), f"{name}/{row['task']}: runs"
            for r in mine:
                fp = fingerprint([[(k, v) for k, v in top] for top in r["tops"]], r["text"])
                assert r["fingerprint"] == fp.ordered, f"{name}/{row['task']}: fingerprint"
                assert r["answer"] == parse_answer(r["text"])
                assert r["correct"] == is_correct(r["answer"], tasks[row["task"]]["expected"])
            assert row["correct"] == sum(r["correct"] for r in mine)
            assert row["logits_stable"] == (len({r["fingerprint"] for r in mine}) == 1), f"{name}/{row['task']}"
            assert row["answers_agree"] == (len({answer_key(r["text"]) for r in mine}) == 1), f"{name}/{row['task']}"
            assert row["hidden_drift"] == (row["answers_agree"] and not row["logits_stable"])
        rows = arm["per_task"]
        assert arm["logits_stable"] == sum(r["logits_stable"] for r in rows)
        assert arm["same_answers_different_logits"] == sum(r["hidden_drift"] for r in rows)
        facts[name] = {k: arm[k] for k in ("accuracy", "answers_agree", "logits_stable",
                                          "same_answers_different_logits", "answers_changed_vs_reference")}  # fmt: skip
        facts[name]["tasks"] = len(rows)
    arms = summary["arms"]
    unstable = any(not r["logits_stable"] for a in arms for r in a.get("per_task", []))
    expected = 2 if any(a["error"] for a in arms) else (1 if unstable else 0)
    assert code == expected, f"exit status {code}, the records call for {expected}"
    return facts


def early_deaths(run_dir: Path) -> list[dict[str, Any]]:
    """The arms whose server exited before it answered anything (a crash at load or on the first request):
    each with the arm, the error and the last lines of the server's log. The probe reports them as arm
    errors (exit status 2), which its contract allows; a test run must still say so loudly, or an engine
    that never ran looks like an engine that was measured."""
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line.strip()]
    deaths = []
    for r in records:
        if r["type"] != "arm_error" or "exited with" not in r["error"]:
            continue
        answered = any(x["type"] == "response" and x.get("attempt") == r["attempt"] for x in records)
        if not answered:
            tail = (r.get("log_tail") or r["error"]).splitlines()[-12:]
            deaths.append({"arm": r["arm"], "error": r["error"].splitlines()[0][:200], "log_tail": tail})
    return deaths
