"""A short soak (the full one is ``kvwarden bench soak`` with 10,000 requests): a real server under concurrent load,
client disconnects at random moments and malformed bodies; afterwards nothing is leaked and replayed
requests give the same fingerprints as under load."""

from __future__ import annotations

import json
import subprocess
import sys


def test_short_soak_leaks_nothing_and_changes_no_answer() -> None:
    args = ["--model", "builtin:qwen3_next-tiny", "--requests", "160", "--concurrency", "16", "--replays", "20"]
    done = subprocess.run(
        [sys.executable, "-m", "kvwarden", "bench", "soak", *args, "--max-seconds", "300"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1])
    assert done.returncode == 0 and result["ok"], done.stdout[-3000:] + done.stderr[-3000:]
    assert result["5xx"] == 0 and result["replays_differing"] == 0 and result["replayed"] == 20
    assert result["leaked_kv_blocks"] == 0 and result["leaked_state_slots"] == 0
    outcomes = result["outcomes"]
    assert any(k.startswith("abort: aborted") for k in outcomes) and any(k.startswith("malformed: 4") for k in outcomes)
    assert outcomes.get("normal: completed", 0) > 80
