"""Convert our Hugging Face checkpoints to GGUF with llama.cpp's own converter.

Uses ``convert_hf_to_gguf.py`` and the ``gguf-py`` vendored in the llama.cpp
sources that ``scripts/build_llama_server.sh`` unpacked (PyPI's ``gguf`` lacks
symbols the converter needs). The converter refuses BPE pre-tokenizers it does
not know; ours is plain byte-level BPE, so it is declared as ``gpt-2``
(docs/engines.md: the converted checkpoint matches transformers).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvwarden.probe.launchers import engines_dir

_SCRIPT = """
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert_to_gguf(
    model_dir: str | Path, out_file: str | Path, outtype: str = "f32", extra: tuple[str, ...] = ()
) -> Path:
    """Write ``out_file`` (a .gguf) from an HF model directory; raises RuntimeError with the converter's output."""
    src = engines_dir() / "llama.cpp" / "src"
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"{src}: llama.cpp sources missing (run scripts/build_llama_server.sh)")
    out = Path(out_file)
    cmd = [sys.executable, "-c", _SCRIPT, str(src), str(model_dir), "--outfile", str(out), "--outtype", outtype, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(
            f"convert_hf_to_gguf failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    return out
