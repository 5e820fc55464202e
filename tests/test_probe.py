"""The probe against kvwarden servers it starts itself: scenarios, reports, resume, failures,
and the closed loop between the predictor and what the probe observes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvwarden.models.tokenizer import Tokenizer
from kvwarden.probe.builtin import Shape, build, prompts
from kvwarden.probe.launchers import KvwardenLauncher, ServerSettings, TemplateLauncher, free_port
from kvwarden.probe.predict import predict_pair
from kvwarden.probe.report import contamination_verdict, summarize
from kvwarden.probe.runner import RecordLog, Target, run_probe
from kvwarden.probe.scenario import ScenarioError, load_scenario
from probe_contract import check_run, early_deaths

LEGACY = ServerSettings(
    block_size=16,
    max_num_batched_tokens=512,
    chunking="legacy-align",
    numerics="shape-dependent",
    num_speculative_tokens=1,
)


@pytest.fixture(scope="module")
def hybrid(qwen3_next_tiny: Path) -> Path:
    return qwen3_next_tiny


def _probe(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvwarden.cli", "probe", "--no-progress", "--out", str(tmp), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)


def test_cli_contamination_on_the_legacy_reproduction_flags_it(hybrid: Path, tmp_path: Path) -> None:
    args = ["--launcher", "kvwarden", "--model", str(hybrid), "--chunking", "legacy-align"]
    args += ["--numerics", "shape-dependent", "--block-size", "16", "--max-num-batched-tokens", "512"]
    args += ["--num-speculative-tokens", "1", "--repeats", "4", "--json"]
    done = _probe(args, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr  # an unstable arm
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    arms = {a["arm"]: a for a in summary["arms"]}
    assert arms["clean"]["stable"] and arms["no-cache"]["stable"]
    assert not arms["contaminated"]["stable"]
    assert arms["contaminated"]["cached_tokens"][0] == 0 and arms["contaminated"]["first_divergent_token"] == 0
    assert arms["no-cache"]["cached_tokens"] == [0, 0, 0, 0]
    records = RecordLog(tmp_path / "records.jsonl").read()
    responses = [r for r in records if r["type"] == "response"]
    assert len(responses) == 4 + 5 + 4 and all(len(r["tops"][0]) == 20 for r in responses)
    assert len(list((tmp_path / "logs").glob("*.log"))) == 3  # a fresh server per arm, log kept
    page = (tmp_path / "report.html").read_text()
    assert "UNSTABLE" in page and page.count("plotly-graph-div") >= 1  # the Δ-logprob plot
    # the churn plot, or the sentence that stands in for a plot of zeros
    assert "candidate-set churn per generated token" in page or "(churn 0)" in page
    assert "<script src='plotly.min.js'>" in page and (tmp_path / "plotly.min.js").stat().st_size > 1_000_000
    summary_file = json.loads((tmp_path / "summary.json").read_text())
    assert summary_file == summary and summary["prediction"]["matches"]


def test_kvwarden_defaults_pass_every_builtin(hybrid: Path, tmp_path: Path) -> None:
    for scenario in ("contamination", "batch", "budget", "repeat"):
        args = ["--launcher", "kvwarden", "--model", str(hybrid), "--scenario", scenario, "--repeats", "3"]
        done = _probe(args, tmp_path / scenario)
        assert done.returncode == 0, f"{scenario}: {done.stdout}{done.stderr}"
        summary = json.loads((tmp_path / scenario / "summary.json").read_text())
        assert all(summary["cross_arm"].values()), scenario


def _pairs() -> list[Shape]:
    """Eight (A, B, shared) triples on documents the rule code never saw, aimed around block edges."""
    # predicted under vllm-align (block 16, pull-back 1): five unstable, one stable but history-dependent,
    # two stable and history-independent (A's first chunk is exactly B's first chunk)
    triples = [
        (20, 60, 18),
        (28, 60, 24),
        (31, 60, 24),
        (33, 60, 24),
        (40, 70, 36),
        (47, 70, 40),
        (50, 60, 40),
        (55, 62, 45),
    ]
    return [Shape(a, b, s, document=2 + i, other=12 - i) for i, (a, b, s) in enumerate(triples)]


@pytest.mark.parametrize(("settings", "rule"), [(LEGACY, "vllm-align"), (ServerSettings(block_size=16), "kvwarden")])
def test_closed_loop_predictions_equal_observations(
    hybrid: Path, tmp_path: Path, settings: ServerSettings, rule: str
) -> None:
    tok = Tokenizer.from_dir(hybrid)
    mismatches = []
    for i, shape in enumerate(_pairs()):
        scenario = build("contamination", settings, tok, shape, repeats=3, max_tokens=4)
        scenario = type(scenario)(scenario.name, scenario.requests, scenario.arms[:2], 4, 20, ("clean", "contaminated"))
        records = run_probe(
            scenario, Target(launcher=KvwardenLauncher(), model=str(hybrid), tokenizer=tok), tmp_path / str(i), False
        )
        observed = contamination_verdict(summarize(records, ["clean", "contaminated"]))
        a, b = prompts(shape, tok)
        pred = predict_pair(
            rule, 16, len(a), len(b), shape.shared, settings.num_speculative_tokens if rule != "kvwarden" else 0
        )
        if (pred.repeats_stable, pred.history_dependent) != observed:
            mismatches.append((shape, (pred.repeats_stable, pred.history_dependent), observed, pred.explanation))
        if rule == "kvwarden":
            assert observed == (True, False)
    assert not mismatches, mismatches


def test_scenario_file_and_its_errors(tmp_path: Path, hybrid: Path) -> None:
    good = tmp_path / "s.yaml"
    good.write_text(
        "name: lease\nmax_tokens: 4\nserver: {block_size: 16}\n"
        "documents:\n  lease: {bundled: 1}\n  note: {text: 'A short note about the boiler.'}\n"
        "requests:\n  A: {document: lease, question: 'Who signed it?'}\n"
        "  B: {document: note, question: 'What broke?'}\n"
        "arms:\n  clean: {steps: [{request: B, repeat: 3}]}\n"
        "  contaminated: {steps: [{request: A}, {request: B, repeat: 3}]}\n"
        "compare_arms: [clean, contaminated]\n"
    )
    scenario = load_scenario(good)
    assert [a.name for a in scenario.arms] == ["clean", "contaminated"] and scenario.arms[1].measured_step == 1
    done = _probe(["--launcher", "kvwarden", "--model", str(hybrid), "--scenario", str(good)], tmp_path / "run")
    assert done.returncode == 0, done.stdout + done.stderr
    bad_cases = {
        "arms:\n  x: {steps: [{request: Z}]}\nrequests:\n  A: {prompt: 'hi'}\n": (
            "s1.yaml:2",
            "arms.x.steps[0].request",
            "unknown request 'Z'",
        ),
        "requests:\n  A: {prompt: 'hi'}\narms:\n  x: {steps: [{request: A, repeat: 'two'}]}\n": (
            "s2.yaml:4",
            "repeat",
            "expected int",
        ),
        "requests:\n  A: {prompt: hi}\nbogus: 1\narms: {}\n": ("s3.yaml:3", "bogus", "unknown field"),
        "requests:\n  A: {document: nope}\narms: {}\n": ("s4.yaml:2", "requests.A.document", "unknown document"),
        "requests: [1,\n": ("s5.yaml:", "not valid YAML", ""),
    }
    for i, (text, (where, field, message)) in enumerate(bad_cases.items(), start=1):
        path = tmp_path / f"s{i}.yaml"
        path.write_text(text)
        with pytest.raises(ScenarioError) as err:
            load_scenario(path)
        assert where in str(err.value) and field in str(err.value) and message in str(err.value), str(err.value)
    toml = tmp_path / "t.toml"
    toml.write_text('[requests.A]\nprompt = "hi"\n[arms.x]\nsteps = [{request = "A", repeat = 0}]\n')
    with pytest.raises(ScenarioError, match=r"t.toml:4: arms.x.steps\[0\].repeat"):
        load_scenario(toml)
    cli = _probe(
        ["--launcher", "kvwarden", "--model", str(hybrid), "--scenario", str(tmp_path / "s1.yaml")], tmp_path / "bad"
    )
    assert cli.returncode == 2 and "s1.yaml:2" in cli.stderr


def test_unreachable_and_crashing_servers_are_reported_and_nothing_is_lost(tmp_path: Path, hybrid: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = _probe(
        ["--url", url, "--served-model-name", "m", "--scenario", "repeat", "--repeats", "2"], tmp_path / "down"
    )
    # stopped before anything is written, naming the flag
    assert done.returncode == 2 and "--url: cannot reach" in done.stderr and "ConnectError" in done.stderr
    assert not (tmp_path / "down").exists()
    crash = f"{sys.executable} -c \"import sys; print('boom: cannot bind {{port}}'); sys.exit(3)\""
    done = _probe(
        ["--launcher", "custom", "--command", crash, "--model", "x", "--scenario", "repeat", "--repeats", "2"],
        tmp_path / "crash",
    )
    assert done.returncode == 2
    errors = [r for r in RecordLog(tmp_path / "crash" / "records.jsonl").read() if r["type"] == "arm_error"]
    assert errors and "exited with 3" in errors[0]["error"] and "boom: cannot bind" in errors[0]["error"]
    assert early_deaths(tmp_path / "crash")[0]["arm"] == errors[0]["arm"]
    # resume: a finished run skips its arms, keeps every earlier record and starts no server
    run = tmp_path / "resume"
    args = ["--launcher", "kvwarden", "--model", str(hybrid), "--scenario", "repeat", "--repeats", "2"]
    assert _probe(args, run).returncode == 0
    before = (run / "records.jsonl").read_text()
    with (run / "records.jsonl").open("a") as f:
        f.write('{"type": "response", "arm": "repeat", "trunc')  # a record cut by a crash
    assert _probe(args, run).returncode == 0
    after = (run / "records.jsonl").read_text()
    assert after.startswith(before) and len(list((run / "logs").glob("*.log"))) == 1


def test_a_server_that_dies_under_the_first_request_is_an_arm_error_not_a_hang(tmp_path: Path) -> None:
    script = Path(__file__).parent / "dying_server.py"
    command = f"{sys.executable} {script} {{port}}"
    args = ["--launcher", "custom", "--command", command, "--model", "x", "--scenario", "contamination"]
    done = _probe([*args, "--repeats", "2", "--json"], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    check_run(tmp_path, done.returncode, summary)
    for arm in summary["arms"]:  # every arm started its own server, which died under its first request
        assert "server exited with 7 during the arm" in arm["error"], arm
        assert "simulated kernel crash under /v1/completions" in arm["error"], arm  # the log's tail is kept
    # what the real-engine tests print loudly: every arm died before its first answer, with the log's last lines
    deaths = early_deaths(tmp_path)
    assert [d["arm"] for d in deaths] == [a["arm"] for a in summary["arms"]]
    assert all(any("simulated kernel crash" in line for line in d["log_tail"]) for d in deaths), deaths
    assert summary["prediction"] == {"skipped": "no scheduling model for custom serving this model"}


def test_the_predictor_uses_the_block_size_the_server_reports_not_the_requested_one(
    hybrid: Path, tmp_path: Path
) -> None:
    """The probe asks for 16-token blocks, an extra server argument makes it 32: the probe must learn 32
    from the server's /metrics, and the predictor must match the server's cache hits with it."""
    args = ["--launcher", "kvwarden", "--model", str(hybrid), "--block-size", "16"]
    args += ["--server-arg=--block-size", "--server-arg=32", "--a-len", "40", "--b-len", "60", "--shared", "36"]
    done = _probe([*args, "--repeats", "3", "--json"], tmp_path)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    check_run(tmp_path, done.returncode, summary)
    pred = summary["prediction"]
    assert (pred["block_size"], pred["block_size_source"], pred["rule"]) == (32, "metrics", "kvwarden"), pred
    assert pred["matches"] and pred["observed"]["clean"] == [0, 32, 32], pred
    assert all(arm["server"]["block_size"] == 32 for arm in summary["arms"])
    # What the old code did: predict with the requested block size. It would not match.
    wrong = predict_pair("kvwarden", 16, pred["a_len"], pred["b_len"], pred["shared"], repeats=3)
    assert wrong.clean_cached_tokens != pred["observed"]["clean"]
    assert "block size 32 (metrics)" in done.stderr  # and the terminal says so


def test_command_template_launcher_needs_a_port() -> None:
    with pytest.raises(ValueError, match="must contain"):
        TemplateLauncher("server --model {model}")


def test_cli_spec_scenario_on_kvwarden_with_mtp_is_stable_and_equal_to_speculation_off(
    hybrid: Path, tmp_path: Path
) -> None:
    args = ["--launcher", "kvwarden", "--model", str(hybrid), "--scenario", "spec", "--spec-method", "mtp"]
    args += ["--num-speculative-tokens", "3", "--repeats", "3", "--json"]
    done = _probe(args, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    arms = {a["arm"]: a for a in summary["arms"]}
    assert arms["spec-off"]["stable"] and arms["spec-on"]["stable"]
    assert set(arms["spec-off"]["fingerprints"]) == set(arms["spec-on"]["fingerprints"])
    assert all(summary["cross_arm"].values()), summary["cross_arm"]


def test_probe_url_counts_lengths_in_tokens_through_the_servers_tokenize(tmp_path: Path, hybrid: Path) -> None:
    """Without a local tokenizer, ``--url`` asks the server's /tokenize: B is exactly --b-len tokens. A server
    without /tokenize (the guard here) gets a loud warning that the lengths are words."""
    from server_util import running_guard, running_server

    with running_server(str(hybrid), "--served-model-name", "m") as s:
        args = ["--url", s.url, "--served-model-name", "m", "--scenario", "repeat", "--repeats", "2", "--b-len", "44"]
        done = _probe(args, tmp_path / "tok")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"tokens (the server's {s.url}/tokenize)" in done.stdout
        records = RecordLog(tmp_path / "tok" / "records.jsonl").read()
        assert {r["prompt_tokens"] for r in records if r["type"] == "response"} == {44}
        report = (tmp_path / "tok" / "report.html").read_text()
        assert "STABLE" in report and "a running server (--url)" in report and "B 44" in report
        assert "each run isolated by its own cache_salt" in report and not (tmp_path / "tok" / "plotly.min.js").exists()
        with running_guard([s.url], "--canary-interval", "0") as g:
            args[1] = g.url
            done = _probe(args, tmp_path / "words")
            assert "/tokenize did not answer" in done.stderr and "WORDS" in done.stdout


SERVER_SCRIPT = """
import http.server, pathlib, socket, sys
port, held, marker, failures = int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3]), int(sys.argv[4])
tries = int(marker.read_text()) if marker.exists() else 0
marker.write_text(str(tries + 1))
if tries < failures:  # the port another process took between choosing and binding: the OS's own error
    try:
        socket.create_server(("127.0.0.1", held))
    except OSError as exc:
        print(f"cannot listen: {exc}", flush=True)
        sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.mark.parametrize("failures", [1, 3])
def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(tmp_path: Path, failures: int) -> None:
    import socket

    from kvwarden.probe.launchers import PORT_ATTEMPTS, ServerFailed

    script, marker = tmp_path / "server.py", tmp_path / "tries"
    script.write_text(SERVER_SCRIPT)
    with socket.create_server(("127.0.0.1", 0)) as held:
        taken = held.getsockname()[1]
        launcher = TemplateLauncher(f"{sys.executable} {script} {{port}} {taken} {marker} {failures}")
        if failures < PORT_ATTEMPTS:
            server = launcher.start("m", ServerSettings(), tmp_path, "retry")
            try:
                assert server.process.poll() is None and int(marker.read_text()) == failures + 1
            finally:
                server.stop()
        else:  # every attempt collides: the error names it, after PORT_ATTEMPTS starts
            with pytest.raises(ServerFailed, match=r"(?i)address already in use"):
                launcher.start("m", ServerSettings(), tmp_path, "retry")
            assert int(marker.read_text()) == PORT_ATTEMPTS


def test_a_server_that_needs_a_key_stops_the_probe_at_once_naming_the_flag(tmp_path: Path, llama_tiny: Path) -> None:
    import os

    from server_util import running_server

    with running_server(str(llama_tiny), "--api-key", "s3cret", "--served-model-name", "m") as server:
        args = ["--url", server.url, "--served-model-name", "m", "--scenario", "repeat", "--repeats", "2"]
        env = {k: v for k, v in os.environ.items() if k != "KVWARDEN_API_KEY"}
        cmd = [sys.executable, "-m", "kvwarden.cli", "probe", *args]
        keyless = subprocess.run([*cmd, "--out", str(tmp_path / "a")], capture_output=True, text=True, env=env)
        assert keyless.returncode == 2 and "needs a key: pass --api-key" in keyless.stderr
        assert not (tmp_path / "a").exists()
        wrong_key = [*cmd, "--api-key", "nope", "--out", str(tmp_path / "b")]
        wrong = subprocess.run(wrong_key, capture_output=True, text=True)
        assert wrong.returncode == 2 and "--api-key: the server" in wrong.stderr and "refused the key" in wrong.stderr
        # the key from the environment, as the server takes it; the lengths line says the lengths
        keyed = subprocess.run(
            [*cmd, "--no-progress", "--out", str(tmp_path / "c")],
            capture_output=True, text=True, env={**env, "KVWARDEN_API_KEY": "s3cret"},
        )  # fmt: skip
        assert keyed.returncode == 0, keyed.stdout[-2000:] + keyed.stderr[-2000:]
        assert re.search(r"prompt lengths in tokens .*: A \d+, B \d+, shared \d+", keyed.stdout), keyed.stdout
