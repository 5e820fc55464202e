"""Record the Triton launches of a CPU run under the interpreter, then lower each one for a Hopper GPU.

The interpreter runs a kernel's body as NumPy and never runs Triton's front end, so a kernel it runs can
still be refused by the GPU's compiler: a loop-carried value whose type changes, a constexpr where a tensor
is needed, an argument the code generator cannot type. ``Launches`` records what real calls launch (the
kernel, each runtime argument's Triton type, each constexpr's value, the warps); ``python -m gpu_lowering
FILE`` - a process *without* the interpreter, where ``@triton.jit`` gives the compiler's ``JITFunction`` -
lowers every recorded specialization to Triton IR for sm_90, the step that refused the top-k on the H100
(2026-12-07), with no GPU. Later stages (the GPU's layouts, PTX) need the GPU and stay in
``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch

POINTEE = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
}  # fmt: skip


# Constants that kernels set from whether the interpreter runs them (``INTERPRETED``): each recorded launch
# is lowered as recorded and again with the GPU's value, the form the GPU compiles.
GPU_VALUES = {"BY_SUM": False, "DOT": True}


def triton_type(value: object) -> str:
    """The Triton signature type of a runtime argument, as the launcher would infer it."""
    if isinstance(value, torch.Tensor):
        return "*" + POINTEE[value.dtype]
    if isinstance(value, bool):
        return "u1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else ("i64" if value < 2**63 else "u64")
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for an argument of type {type(value).__name__}")


class Launches:
    """Records every interpreted launch while installed (``with Launches() as rec:``), one entry per
    distinct specialization: ``{"module", "name", "signature", "constexprs", "num_warps"}``."""

    def __init__(self) -> None:
        self.specs: dict[str, dict[str, Any]] = {}

    def __enter__(self) -> Launches:
        from triton.runtime.interpreter import InterpretedFunction

        self._cls, self._run = InterpretedFunction, InterpretedFunction.run
        record, run = self.record, self._run

        def recording_run(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            record(kernel.fn, args, kwargs, kernel.kwargs.get("do_not_specialize") or ())
            return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self._cls.run = self._run  # type: ignore[method-assign]

    def record(self, fn: Any, args: tuple, kwargs: dict[str, Any], unspecialized: tuple = ()) -> None:
        params = inspect.signature(fn).parameters
        names = list(params)
        kept = {names[u] if isinstance(u, int) else u for u in unspecialized}  # named or by position
        bound = dict(zip(params, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        for name, param in params.items():
            value = bound.get(name, param.default)
            # NOTE: the launcher makes an int argument equal to 1 a constant unless told not to specialize it
            one = isinstance(value, int) and not isinstance(value, bool) and value == 1 and name not in kept
            if "constexpr" in str(param.annotation) or value is None or one:
                constexprs[name] = value
                signature[name] = "constexpr"
            else:
                signature[name] = triton_type(value)
        spec = dict(module=fn.__module__, name=fn.__name__, signature=signature, constexprs=constexprs,
                    num_warps=int(kwargs.get("num_warps", 4)))  # fmt: skip
        self.specs[json.dumps(spec, sort_keys=True, default=str)] = spec

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(list(self.specs.values())))


def lower(spec: dict[str, Any]) -> None:
    """Lower one recorded launch to Triton IR for sm_90 (raises the compiler's error)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({"num_warps": spec["num_warps"]})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(kernel, spec["signature"], spec["constexprs"])
    source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


def main(path: str) -> None:
    """Lower every launch recorded in ``path``; print one JSON line: how many, and each failure."""
    recorded = json.loads(Path(path).read_text())
    specs = list(recorded)
    for spec in recorded:  # the GPU's value of each interpreter-only constant
        gpu = {k: v for k, v in GPU_VALUES.items() if k in spec["constexprs"] and spec["constexprs"][k] != v}
        if gpu:
            specs.append({**spec, "constexprs": {**spec["constexprs"], **gpu}})
    failed = []
    for spec in specs:
        try:
            lower(spec)
        except Exception as exc:  # every failure is reported, the rest still lowered
            failed.append({"kernel": spec["name"], "constexprs": spec["constexprs"], "error": str(exc)[-600:]})
    print(json.dumps({"lowered": len(specs) - len(failed), "failed": failed}))


if __name__ == "__main__":
    main(sys.argv[1])
