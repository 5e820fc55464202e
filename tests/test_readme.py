"""Everything the README (and the user guides it sends readers to) names exists: paths, make targets, commands
and their flags, Python API names.

The README is parsed, not copied: its code blocks give commands (``make X``,
``kvwarden SUB --flag``, ``kvwarden bench NAME --flag``, ``scripts/X.sh``) and its
inline code and links give paths. Each ``kvwarden`` sub-command's ``--help`` is
run once and must list every flag the README uses with it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The README is a landing page; the guides its sections moved into are held to the same standard.
GUIDES = ("README.md", "docs/engine.md", "docs/serving.md", "docs/probe.md", "docs/gpu.md", "docs/benchmarks.md",
          "docs/structured.md")  # fmt: skip
README = "\n".join((ROOT / name).read_text() for name in GUIDES)
PATH_PREFIXES = ("docs/", "scripts/", "bench/", "tests/", "src/", ".ci/")  # runs/ holds outputs: not checked


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def command_lines() -> list[list[str]]:
    """Shell commands of the README's bash blocks, continuations joined, comments dropped."""
    out = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(shlex.split(line.replace("[", " ").replace("]", " ").replace("|", " ")))
    return out


@cache
def help_text(*sub: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvwarden.cli", *sub, "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"kvwarden {' '.join(sub)} --help failed: {done.stderr}"
    return done.stdout


def test_kvwarden_commands_and_flags_exist() -> None:
    seen = 0
    for words in command_lines():
        if words[0] != "kvwarden":
            continue
        groups = [((words[1],), words[2:])]
        if words[1] == "bench":  # the entry point's flags before NAME, a benchmark's own after it
            rest = words[2:]
            own = 2 if rest[:1] == ["--result"] else 0
            if rest[:1] != ["--summarize"] and len(rest) > own:
                groups = [(("bench",), rest[:own]), (("bench", rest[own]), rest[own + 1 :])]
        for sub, flags in groups:
            text = help_text(*sub)
            for word in flags:
                if word.startswith("--"):
                    flag = word.split("=", 1)[0]
                    found = re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", text)
                    assert found, f"README: kvwarden {' '.join(sub)} {flag}"
        seen += 1
    assert seen >= 5, "the README shows kvwarden commands"


def test_make_targets_scripts_and_benchmarks_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for words in command_lines():
        if words[0] == "make":
            for target in words[1:]:
                assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"README: make {target}"
        for word in words:
            if word.startswith(PATH_PREFIXES) and "*" not in word and "{" not in word:
                assert (ROOT / word).exists(), f"README names {word}, which does not exist"


def test_paths_in_inline_code_and_links_exist() -> None:
    spans = re.findall(r"`([^`\n]+)`", README) + re.findall(r"\]\(([^)#]+)\)", README)
    for span in spans:
        for word in span.split():
            word = word.rstrip(".,:;)")
            if word.startswith(PATH_PREFIXES) and "*" not in word and "{" not in word and "<" not in word:
                assert (ROOT / word).exists(), f"README names {word}, which does not exist"


def test_python_examples_use_real_names() -> None:
    import kvwarden

    for block in code_blocks("python"):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "kvwarden":
                for alias in node.names:
                    assert hasattr(kvwarden, alias.name), f"README imports kvwarden.{alias.name}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in kvwarden.__all__:
                target = getattr(kvwarden, node.func.id)
                if dataclasses.is_dataclass(target):  # SamplingParams validates **kwargs against its fields
                    names = {f.name for f in dataclasses.fields(target)}
                else:
                    names = set(inspect.signature(target).parameters)
                for kw in node.keywords:
                    assert kw.arg in names, f"README: {node.func.id}({kw.arg}=...) is not a parameter"
