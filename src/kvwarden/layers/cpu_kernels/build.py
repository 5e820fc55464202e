"""Compile the CPU kernels (``csrc/*.cpp``) once per machine and cache the shared library.

The library is plain C++ behind an ``extern "C"`` interface, loaded with
``ctypes``: no Python headers, no torch headers, a few seconds of ``g++``. It is
built for this machine's instruction set (``-march=native``) and cached under
``$KVWARDEN_HOME/kernels`` (default ``~/.cache/kvwarden/kernels``), keyed by the
sources, the compiler, its flags and the CPU's feature flags: another machine,
compiler or source builds its own. ``scripts/install.sh`` builds it during the
install; an engine builds it on first use when the cache has none.

OpenMP: the library links ``libgomp.so.1`` by soname, and torch has already
loaded its own copy under that soname when the library is opened, so the
kernels share torch's thread pool and follow ``torch.set_num_threads``.

Failure is not fatal: :func:`build` raises :class:`BuildError` with the reason
and the log's path; the CPU backend then keeps the PyTorch kernels and says why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvwarden.home import cache_home

SOURCES = ("gemm.cpp", "attention.cpp", "rows.cpp")
HEADERS = ("common.h", "microkernel.h")
# -ffp-contract=off: no multiply and add is fused unless the source says std::fma (common.h says why)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-ffp-contract=off")
CSRC = Path(__file__).resolve().parent / "csrc"


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded here (the message says why)."""


def compiler() -> str:
    """The C++ compiler: ``$CXX``, else ``g++`` or ``c++`` on the PATH.

    Raises:
        BuildError: none is found.
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise BuildError("no C++ compiler: set CXX or install g++ (the README's prerequisites name it)")
    return cxx


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def library_path(cxx: str) -> Path:
    """Where the library for these sources, this compiler and this CPU is cached."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"C++ compiler {cxx!r} does not run: {exc}") from exc
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    for part in (cxx, version, " ".join(FLAGS), _cpu_flags()):
        digest.update(part.encode())
    return cache_home() / "kernels" / f"kvwarden_cpu-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """The cached library's path, compiling it first if it is missing.

    Concurrent builders (two test workers, two servers) each compile into a
    temporary file and rename it into place: the rename is atomic, so nobody
    opens a half-written library.

    Raises:
        BuildError: no compiler, or the compiler failed (the message carries the
            end of its output and the log file's path).
    """
    cxx = compiler()
    path = library_path(cxx)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_suffix(".log")
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *FLAGS, *(str(CSRC / s) for s in SOURCES), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        os.unlink(tmp)
        raise BuildError(f"compiling the CPU kernels failed to run ({exc})") from exc
    log.write_text(" ".join(cmd) + "\n" + done.stdout + done.stderr)
    if done.returncode != 0:
        os.unlink(tmp)
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise BuildError(
            f"compiling the CPU kernels failed ({cxx}, exit {done.returncode}; log {log}): {' | '.join(tail)}"
        )
    os.replace(tmp, path)
    return path


if __name__ == "__main__":  # scripts/install.sh: python -m kvwarden.layers.cpu_kernels.build
    import sys

    try:
        print(f"CPU kernels: {build()}")
    except BuildError as exc:
        print(f"CPU kernels: {exc}", file=sys.stderr)
        sys.exit(1)
