"""The command line as a user meets it: help, errors, progress and output formats."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvwarden.cli import build_parser

KVWARDEN = [sys.executable, "-m", "kvwarden.cli"]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVWARDEN, *args], capture_output=True, text=True, timeout=timeout, check=False)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_flag_has_help_and_shows_its_default() -> None:
    for name, parser in _commands().items():
        for action in parser._actions:
            if action.dest == "help":
                continue
            assert action.help, f"kvwarden {name} {action.option_strings or action.dest}: no help text"
        text = parser.format_help()
        for action in parser._actions:
            meaningful = action.default not in (None, False, [], argparse.SUPPRESS) and not action.required
            if action.option_strings and meaningful and action.dest != "help":
                assert "(default:" in text, f"kvwarden {name}: defaults not shown"


def test_help_is_instant_and_imports_no_torch() -> None:
    probe = "import sys, kvwarden.cli as c; c.build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"  # torch takes seconds to import; help must not wait for it
    for name in ("", *_commands()):
        start = time.perf_counter()
        done = _run(*([name] if name else []), "--help")
        assert done.returncode == 0 and "usage: kvwarden" in done.stdout, done.stderr
        assert time.perf_counter() - start < 10


def test_generate_shows_top_logprobs_in_plain_and_json(llama_tiny: Path) -> None:
    args = ["generate", str(llama_tiny), "--prompt", "Hello there", "--max-tokens", "4", "--logprobs", "3"]
    plain = _run(*args)
    assert plain.returncode == 0, plain.stderr
    assert "top-3 per token" in plain.stdout and "top candidates (logprob)" in plain.stdout
    assert plain.stdout.count("\n") >= 4 + 3  # text, title, header, one row per generated token
    assert "loading" in plain.stderr and "loaded LlamaForCausalLM" in plain.stderr  # a sign of life while loading
    as_json = _run(*args, "--json")
    out = json.loads(as_json.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == len(out["token_ids"]) == 4
    assert all(len(top) == 3 and set(top[0]) == {"token_id", "token", "logprob"} for top in out["logprobs"])
    assert out["logprobs"][0][0]["token_id"] == out["token_ids"][0]


def test_builtin_models_are_announced_as_random_weights() -> None:
    done = _run("generate", "builtin:llama-tiny", "--prompt", "x", "--max-tokens", "1")
    assert done.returncode == 0 and "seeded random weights" in done.stderr


def test_serve_on_a_busy_port_says_so_in_one_line(llama_tiny: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        start = time.perf_counter()
        done = _run("serve", str(llama_tiny), "--port", str(port), timeout=60)
    assert done.returncode == 1
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    expected = f"kvwarden serve: error: cannot listen on 127.0.0.1:{port} (--host/--port): Address already in use"
    assert lines == [expected]
    assert time.perf_counter() - start < 20  # refused before loading the model


def test_bad_flag_values_name_the_flag() -> None:
    done = _run("serve", "builtin:llama-tiny", "--block-size", "0")
    assert done.returncode == 2 and "--block-size" in done.stderr and "must be >= 1" in done.stderr
    done = _run("serve", "builtin:llama-tiny", "--threads", "0")
    assert done.returncode == 2 and "--threads" in done.stderr and "must be >= 1" in done.stderr
    done = _run("generate", "no/such/model", "--prompt", "x")
    assert done.returncode == 2 and "no/such/model" in done.stderr and "Traceback" not in done.stderr
    # the program names its command (a command's own --command flag once overwrote the name: "kvwarden None")
    done = _run("probe", "--scenario", "contamnation", "--launcher", "kvwarden", "--model", "builtin:llama-tiny")
    assert done.returncode == 2 and done.stderr.startswith("kvwarden probe: error: --scenario"), done.stderr
    assert "did you mean 'contamination'" in done.stderr and "batch, budget, spec, topk, repeat" in done.stderr
    done = _run("probe", "--repeats", "1", "--launcher", "kvwarden", "--model", "builtin:llama-tiny")
    assert done.returncode == 2 and "kvwarden probe: error: --repeats must be >= 2" in done.stderr, done.stderr


def test_make_model_from_a_published_config(tmp_path: Path) -> None:
    config = Path(__file__).resolve().parent.parent / "bench" / "configs" / "smollm2-135m.json"
    done = _run("make-model", "--config", str(config), "--num-layers", "2", "--out", str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    done = _run("make-model", "--config", str(config), "--arch", "llama", "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and "--config: replaces --arch" in done.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"architectures": ["PhiForCausalLM"], "num_hidden_layers": 2}))
    done = _run("make-model", "--config", str(bad), "--out", str(tmp_path / "y"))
    assert done.returncode == 2 and "PhiForCausalLM" in done.stderr and "Traceback" not in done.stderr
