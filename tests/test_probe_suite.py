"""``kvwarden probe --suite``: the built-in invoice suite, suite files, and the three measures side by side.

Real ``kvwarden serve`` processes started by the probe; every reported number is recomputed from the run's
raw records (``probe_contract.check_suite_run``). The legacy reproduction (vLLM's align rule with
shape-dependent kernels) must show what the issue is about: tasks whose answers agree across runs while
their logits do not; kvwarden's canonical engine must keep every task's logits stable in every arm.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvwarden.probe.invoices import builtin_suite, iso, local_amount, local_date
from kvwarden.probe.suite import SuiteError, Task, constraint_body, is_correct, load_suite, parse_answer, write_suite
from probe_contract import check_suite_run

MONTHS_HU = "január|február|március|április|május|június|július|augusztus|szeptember|október|november|december"


def _probe(args: list[str], out: Path) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "kvwarden.cli", "probe", "--no-progress", "--json", "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
    assert done.returncode in (0, 1, 2), done.stdout[-2000:] + done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_the_built_in_suite_is_fifty_tasks_whose_truth_is_in_their_documents() -> None:
    tasks = builtin_suite("invoices-50")
    assert len(tasks) == 50 and tasks == builtin_suite("invoices-50")  # deterministic
    assert len({t.id for t in tasks}) == 50
    by_doc: dict[str, list[Task]] = {}
    for t in tasks:
        by_doc.setdefault(t.document, []).append(t)
    assert len(by_doc) == 20 and all(len(group) in (2, 3) for group in by_doc.values())  # documents are shared
    assert {t.meta["language"] for t in tasks} == {"hu", "en", "de"}
    hungarian = [t for t in tasks if t.meta["language"] == "hu"]
    assert all(re.search(rf"2026\. ({MONTHS_HU}) \d{{1,2}}\.", t.document) for t in hungarian)
    assert all(re.search(r"\d{1,3}(?: \d{3})+ Ft", t.document) for t in hungarian)  # e.g. 12 345 Ft
    for t in tasks:  # the truth is what the document says, in the document's own format
        lang = t.meta["language"]
        if "date" in t.expected:
            y, m, d = map(int, t.expected["date"].split("-"))
            assert local_date(lang, (y, m, d)) in t.document and iso((y, m, d)) == t.expected["date"]
        if "amount" in t.expected:
            total_line = t.document.splitlines()[-1]
            assert total_line.endswith(local_amount(lang, t.expected["amount"])), (total_line, t.expected)
        if "number" in t.expected:
            assert t.expected["number"] in t.document
        assert t.schema is not None and set(t.expected) <= set(t.schema["properties"])


def test_suite_files_round_trip_and_errors_name_file_line_and_field(tmp_path: Path) -> None:
    tasks = builtin_suite("invoices-50")[:5]
    path = tmp_path / "five.jsonl"
    write_suite(tasks, path)
    assert [(t.id, t.document, t.question, t.expected, t.schema) for t in load_suite(path)] == [
        (t.id, t.document, t.question, t.expected, t.schema) for t in tasks
    ]
    good = {"id": "a", "document": "Invoice 7", "question": "Number?", "expected": {"n": 7}}
    cases = {
        "unknown field": ({**good, "expeted": {}}, r"bad\.jsonl:2: expeted: unknown field"),
        "no truth": ({k: v for k, v in good.items() if k != "expected"}, r"bad\.jsonl:2: expected: required"),
        "empty question": ({**good, "question": " "}, r"bad\.jsonl:2: question: required"),
        "schema not an object": ({**good, "schema": "json"}, r"bad\.jsonl:2: schema: a JSON schema object"),
        "duplicate id": (good, r"bad\.jsonl:2: id: 'a' appears twice"),
    }
    for what, (second, message) in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(good) + "\n" + json.dumps(second) + "\n")
        with pytest.raises(SuiteError, match=message):
            load_suite(bad)
        assert what
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SuiteError, match=r"bad\.jsonl:1: not valid JSON"):
        load_suite(tmp_path / "bad.jsonl")


def test_answers_are_parsed_and_scored_as_a_client_would() -> None:
    assert parse_answer('Sure! {"date": "2026-09-03"} done') == {"date": "2026-09-03"}
    assert parse_answer('{"date": ') is None and parse_answer("no json") is None
    expected = {"amount": 48260, "currency": "HUF"}
    assert is_correct({"amount": 48260, "currency": "huf "}, expected)
    assert is_correct({"amount": "48 260", "currency": "HUF"}, expected)  # the value, not the schema's type
    assert not is_correct({"amount": 48261, "currency": "HUF"}, expected)
    assert not is_correct({"currency": "HUF"}, expected) and not is_correct(None, expected)
    assert is_correct({"amount": 4739.33}, {"amount": 4739.33}) and not is_correct({"amount": True}, {"amount": 1})
    schema = {"type": "object"}
    assert constraint_body(schema, "response_format")["response_format"]["json_schema"]["schema"] == schema
    compact = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    assert constraint_body(schema, "structured_outputs") == compact
    assert constraint_body(schema, "json_schema") == {"json_schema": schema} and constraint_body(schema, "none") == {}


def test_on_the_legacy_reproduction_answers_agree_while_logits_move(qwen3_next_tiny: Path, tmp_path: Path) -> None:
    args = ["--suite", "invoices-50", "--tasks", "5", "--repeats", "3", "--max-tokens", "16"]
    args += ["--launcher", "kvwarden", "--model", str(qwen3_next_tiny), "--chunking", "legacy-align"]
    args += ["--numerics", "shape-dependent", "--block-size", "16", "--max-num-batched-tokens", "512"]
    code, brief, _ = _probe(args, tmp_path)
    facts = check_suite_run(tmp_path, code, brief)
    assert code == 1, facts
    assert facts["clean"]["logits_stable"] == 5 and facts["no-cache"]["logits_stable"] == 5
    # a task reusing another task's blocks: its runs give the same answers, with other logits
    assert facts["contaminated"]["logits_stable"] < 5 and facts["contaminated"]["same_answers_different_logits"] > 0
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    repeated = [r for r in records if r.get("arm") == "contaminated" and r.get("run", 0) > 0]
    assert repeated and all(r["cached_tokens"] > 0 for r in repeated)  # later runs reuse cached blocks
    page = (tmp_path / "report.html").read_text()
    assert "UNSTABLE" in page and "same answers, other logits" in page
    assert all(f"Arm {arm}: one row per task" in page for arm in ("clean", "contaminated", "no-cache"))
    assert "2026. " in page or "doc00-date" in page  # tasks are named in the per-arm tables


def test_kvwarden_keeps_every_task_stable_with_a_schema_file_and_structured_outputs(
    llama_tiny: Path, tmp_path: Path
) -> None:
    tasks = [
        Task("a-date", "SZÁMLA\nKelt: 2026. szeptember 3.\nFizetendő: 12 345 Ft", "When? (YYYY-MM-DD)",
             {"date": "2026-09-03"}, {"type": "object", "properties": {"date": {"enum": ["2026-09-03", "2026-03-09"]}},
                                      "required": ["date"], "additionalProperties": False}),
        Task("a-total", "SZÁMLA\nKelt: 2026. szeptember 3.\nFizetendő: 12 345 Ft", "How much?",
             {"amount": 12345}, {"type": "object", "properties": {"amount": {"enum": [12345, 2026]}},
                                 "required": ["amount"], "additionalProperties": False}),
    ]  # fmt: skip
    suite = tmp_path / "mine.jsonl"
    write_suite(tasks, suite)
    args = ["--suite", str(suite), "--repeats", "2", "--launcher", "kvwarden", "--model", str(llama_tiny)]
    args += ["--constraint-field", "structured_outputs", "--block-size", "8"]
    code, brief, _ = _probe(args, tmp_path / "run")
    facts = check_suite_run(tmp_path / "run", code, brief)
    assert code == 0 and all(f["logits_stable"] == 2 and f["answers_agree"] == 2 for f in facts.values()), facts
    records = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    answers = [r["answer"] for r in records if r["type"] == "response"]
    # the enum schemas leave two answers each: every output is one of them, so half the tasks' truth is reachable
    assert answers and all(a in ({"date": "2026-09-03"}, {"date": "2026-03-09"}, {"amount": 12345},
                                 {"amount": 2026}) for a in answers), answers  # fmt: skip
    assert all(r["correct"] == (r["answer"] in ({"date": "2026-09-03"}, {"amount": 12345}))
               for r in records if r["type"] == "response")  # fmt: skip


def test_bad_suite_arguments_are_one_line_naming_the_flag(tmp_path: Path) -> None:
    url = ["--url", "http://127.0.0.1:9"]
    cases = {
        ("--suite", "invoice-50", *url): "did you mean 'invoices-50'",
        ("--suite", "invoices-50", "--a-len", "40", *url): "--a-len is for scenarios, not --suite",
        ("--suite", "invoices-50", "--ignore-eos", *url): "--ignore-eos is for scenarios, not --suite",
        ("--tasks", "3", *url): "--tasks needs --suite",
        ("--constraint-field", "none", *url): "--constraint-field needs --suite",
    }
    for args, message in cases.items():
        cmd = [sys.executable, "-m", "kvwarden.cli", "probe", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_run_directory_is_resumed_only_by_the_same_suite(llama_tiny: Path, tmp_path: Path) -> None:
    args = ["--suite", "invoices-50", "--tasks", "1", "--repeats", "2", "--max-tokens", "4"]
    args += ["--launcher", "kvwarden", "--model", str(llama_tiny)]
    code, first, _ = _probe(args, tmp_path)
    assert code == 0, first
    again, resumed, _ = _probe(args, tmp_path)  # every arm done: nothing re-run, the same verdicts
    assert again == 0 and resumed["arms"] == first["arms"]
    cmd = [sys.executable, "-m", "kvwarden.cli", "probe", "--no-progress", "--out", str(tmp_path), *args]
    cmd[cmd.index("--repeats") + 1] = "3"
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 2 and "holds another run (it differs in repeats)" in done.stderr, done.stderr
