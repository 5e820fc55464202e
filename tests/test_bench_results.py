"""One result shape for every bench (``kvwarden bench --result FILE NAME``), the summary that reads those
files (``--summarize``), and the GPU script as a short driver over its stage table.

Real runs: the benches run as a user runs them (``python -m kvwarden bench``), the GPU script runs on
this CPU with its generic ``bench`` stage (no GPU needed to drive it; its rows' own flags say cuda).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvwarden.commands.bench import benches

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TABLE = ROOT / "scripts" / "gpu_stages.txt"
TOPK = ["topk", "--device", "cpu", "--quick", "--no-models"]


def kvwarden_bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvwarden", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_a_result_file_holds_the_benchs_json_in_the_common_shape(tmp_path: Path) -> None:
    done = kvwarden_bench("--result", str(tmp_path / "topk.json"), *TOPK)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])  # the bench's own output passes through
    result = json.loads((tmp_path / "topk.json").read_text())
    assert result["name"] == "topk" and result["status"] == "done" and result["figures"] == printed
    assert result["config"] == {"argv": TOPK[1:]}
    assert result["machine"]["cores"] == os.cpu_count() and result["machine"]["python"]
    assert result["seconds"] >= 0

    failed = kvwarden_bench("--result", str(tmp_path / "scale.json"), "scale")  # --config missing: exit 2
    assert failed.returncode == 2 and "--config" in failed.stderr
    result = json.loads((tmp_path / "scale.json").read_text())
    assert result["status"] == "failed (exit 2)" and result["figures"] is None

    summary = kvwarden_bench("--summarize", str(tmp_path), str(tmp_path / "absent.json"))
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert any(line.startswith("topk ") and "torch.topk / deterministic" in line for line in lines), lines
    assert any(line.startswith("scale ") and "failed (exit 2)" in line for line in lines), lines
    assert any(line.startswith("absent ") and "no result file" in line for line in lines), lines
    both = kvwarden_bench("--result", str(tmp_path / "x.json"), "--summarize", str(tmp_path))
    assert both.returncode == 2 and "--summarize" in both.stderr


def test_a_bench_ended_by_sigterm_says_so_in_its_result(tmp_path: Path, llama_tiny: Path) -> None:
    # what the GPU script's `timeout` does to a bench that overruns: the result must not claim "done"
    out = tmp_path / "offline.json"
    cmd = [sys.executable, "-m", "kvwarden", "bench", "--result", str(out), "offline", "--models", str(llama_tiny)]
    cmd += ["--engines", "kvwarden", "--num-requests", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert json.loads(out.read_text())["status"] == "running"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signal.SIGTERM, proc.stderr.read()[-2000:] if proc.stderr else ""
    assert json.loads(out.read_text())["status"] == f"failed (exit {128 + signal.SIGTERM})"


def table_rows() -> list[tuple[str, str, int, str, list[str]]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            stage, mode, limit, label, command = line.split(maxsplit=4)
            command = re.sub(r"\$\{[A-Z_0-9]+:[-+]([^}]*)\}", r"\1", command)  # a variable's default
            rows.append((stage, mode, int(limit), label, shlex.split(command)))
    return rows


def test_every_stage_row_names_a_bench_or_test_that_exists() -> None:
    names = set(benches())
    rows = table_rows()
    labels = [label for _, _, _, label, _ in rows]
    assert len(labels) == len(set(labels)), "each row writes its own files"
    for stage, mode, limit, label, words in rows:
        assert mode in ("any", "full") and 0 < limit <= 600, (stage, mode, limit)
        kind, *rest = words
        if kind == "pytest":
            paths = [w for w in rest if w.startswith("tests/")]
            assert paths and all((ROOT / p).is_file() for p in paths), (label, paths)
        elif kind == "sh":
            continue
        elif kind != "$BENCH":
            bench = rest[0] if kind == "ref" else kind
            assert bench in names, f"{label}: {bench} is no bench (kvwarden bench --help)"
            # every flag the row passes (defaults of ${VAR:-...} included) is one its bench defines
            source = (ROOT / "src" / "kvwarden" / "bench" / f"{bench}.py").read_text()
            flags = [w.split("=")[0] for w in words if w.startswith("--")]
            assert all(f'"{f}"' in source for f in flags), (label, [f for f in flags if f'"{f}"' not in source])


def test_the_gpu_script_is_a_short_driver_without_inline_python() -> None:
    text = SCRIPT.read_text()
    assert len(text.splitlines()) <= 150
    assert "python3 -c" not in text and "python -c" not in text


def test_the_gpu_script_runs_a_stage_and_prints_the_summary_last(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "BENCH": " ".join(TOPK)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # its python3 is this venv's
    done = subprocess.run(["bash", str(SCRIPT), "quick", "bench"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    tail = done.stdout.split("=== summary", 1)[1].splitlines()[1:]
    assert tail and all(line.startswith("bench ") for line in tail), tail
    assert (tmp_path / "summary.txt").read_text().splitlines() == tail
    assert json.loads((tmp_path / "bench.json").read_text())["status"] == "done"
    wrong = subprocess.run(["bash", str(SCRIPT), "full", "nosuch"], capture_output=True, text=True, env=env, timeout=60)
    assert wrong.returncode == 2 and "no stage 'nosuch'" in wrong.stderr
    listed = subprocess.run(["bash", str(SCRIPT), "list"], capture_output=True, text=True, env=env, timeout=60)
    assert [line.split()[0] for line in listed.stdout.splitlines()] == [row[0] for row in table_rows()]
