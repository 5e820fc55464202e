"""``kvwarden demo`` (the README's main job) end to end: it tells the story and leaves complete run directories."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def test_demo_tells_the_story_and_writes_every_report(qwen3_next_tiny: Path, tmp_path: Path) -> None:
    args = ["demo", "--model", str(qwen3_next_tiny), "--repeats", "3", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "kvwarden.cli", *args], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    for words in ("clean         B alone", "contaminated  A once, then B", "no-cache      B 3 times with prefix"):
        assert words in text  # the arms are explained before they run
    assert "B's runs after A differ from each other" in text  # the production bug, in plain words
    assert "every run of B, after A or alone, is bitwise identical" in text  # kvwarden's defaults
    assert "history-dep" not in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["all_as_predicted"] is True
    spec_row = r"speculative decoding \(mtp, [1-9]\d* draft tokens scored\) on vs off: .* bitwise identical"
    assert re.search(spec_row, text)  # the MTP head really drafted, and nothing moved
    dirs = ("legacy-align/shape-dependent", "legacy-align-fixed/shape-dependent", "kvwarden/canonical")
    for run_dir in (*dirs, "kvwarden/canonical-spec-off"):
        d = tmp_path / run_dir
        for name in ("records.jsonl", "scenario.json", "summary.json", "report.html"):
            assert (d / name).is_file(), f"{run_dir}/{name}"
        records = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
        b_runs = [r for r in records if r["type"] == "response" and r["request"] == "B"]
        assert b_runs and all(len(r["tokens"]) == 32 for r in b_runs)  # enough tokens for the plots
        assert json.loads((d / "summary.json").read_text())["prediction"]["matches"]
    legacy = json.loads((tmp_path / "legacy-align/shape-dependent/summary.json").read_text())
    assert not next(a for a in legacy["arms"] if a["arm"] == "contaminated")["stable"]
    page = (tmp_path / "report.html").read_text()
    assert page.count("plotly-graph-div") >= 1 and "<caption>" in page and (tmp_path / "plotly.min.js").is_file()
    # the churn plot, or the sentence that stands in for a plot of zeros
    assert "candidate-set churn per generated token" in page or "(churn 0)" in page
    assert "(none compared)" not in page
    # the sparse-attention rows: the first incident's selection makes B follow its batch; kvwarden's does not
    assert "B among other requests differs from B alone" in text
    assert "B identical alone and among other requests, in every run" in text
    for run_dir in ("topk/unsafe-topk", "topk/kvwarden"):
        assert (tmp_path / run_dir / "report.html").is_file(), run_dir
