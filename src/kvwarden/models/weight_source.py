"""Where a model's tensors come from, one tensor at a time: safetensors shards read lazily, or seeded random
weights drawn on the device (``load_format="dummy"``, vLLM's spelling), or an already decoded dict (GGUF).

The loader asks a source for a tensor only when the model's construction asks for it, moves it to the
device and drops the host copy: host memory holds one tensor at a time, not the model (a 160 GB checkpoint
loads on a machine with a fraction of that). Shapes and dtypes are read from the files' headers without
touching the data, so shape checks and the memory plan run before the first byte is read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from kvwarden.models.config import ModelConfig
from kvwarden.models.quant import FP8, SCALE_SUFFIX, quantize, scale_shape, stored_fp8
from kvwarden.models.random_weights import WeightSpec, weight_specs

PICKLE_CHECKPOINTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class WeightSource(Protocol):
    """A checkpoint's tensors by name; ``read`` returns one tensor (on ``device`` when it is drawn there)."""

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read(self, name: str, device: torch.device) -> torch.Tensor: ...


def nbytes(source: WeightSource, name: str) -> int:
    shape = source.shape(name)
    count = 1
    for d in shape:
        count *= d
    return count * torch.empty((), dtype=source.dtype(name)).element_size()


class SafetensorsFiles:
    """A (possibly sharded) safetensors checkpoint, headers read at once, data one tensor at a time.

    Raises (at construction): ``ValueError`` for a pickle-only checkpoint (unpickling runs arbitrary code)
    or an unreadable file, naming it; ``FileNotFoundError`` for a shard the index names but the folder
    lacks."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
        files = files or ["model.safetensors"]
        if not (model_dir / files[0]).is_file():
            pickled = [p for p in PICKLE_CHECKPOINTS if (model_dir / p).is_file()]
            if pickled:
                raise ValueError(
                    f"{model_dir / pickled[0]}: pickle checkpoints are refused (loading one runs arbitrary code); "
                    "convert it to safetensors first "
                    "(transformers: model.save_pretrained(dir, safe_serialization=True))"
                )
        self._where: dict[str, object] = {}
        self._file: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name in files:
            file = model_dir / name
            if not file.is_file():
                raise FileNotFoundError(f"{file}: missing weights file")
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error type for a bad header
                raise ValueError(f"{file}: not a readable safetensors file ({exc})") from exc
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                part = handle.get_slice(key)
                dtype = _ST_DTYPES.get(part.get_dtype())
                if dtype is None:
                    raise ValueError(f"{file}: tensor {key!r} has dtype {part.get_dtype()}, which kvwarden cannot read")
                self._where[key], self._file[key] = handle, file
                self._meta[key] = (tuple(part.get_shape()), dtype)

    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def read(self, name: str, device: torch.device) -> torch.Tensor:
        try:
            return self._where[name].get_tensor(name)  # type: ignore[attr-defined]
        except Exception as exc:  # a truncated file fails on the tensors past its end
            raise ValueError(
                f"{self._file[name]}: tensor {name!r} cannot be read ({exc}); is the file truncated?"
            ) from exc


class TensorDict:
    """Tensors already in memory (a decoded GGUF file)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read(self, name: str, device: torch.device) -> torch.Tensor:
        return self.tensors[name]


class DummyWeights:
    """Seeded random weights at the shapes ``config.json`` implies, drawn on the device when asked for: no
    file, no download (vLLM's ``load_format="dummy"``). A tensor's values are a function of the seed and its
    name alone (one generator per tensor), so any order of asking gives the same model; an FP8 config gets
    FP8 weights with block scales, as its checkpoint would hold them."""

    def __init__(self, cfg: ModelConfig, seed: int, dtype: torch.dtype) -> None:
        self.cfg, self.seed, self.compute_dtype = cfg, seed, dtype
        self.specs: dict[str, WeightSpec] = weight_specs(cfg)
        self.quant = cfg.quantization
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, spec in self.specs.items():
            if stored_fp8(name, spec.shape, self.quant):
                assert self.quant is not None
                self._meta[name] = (spec.shape, FP8)
                base = name.removesuffix("weight")
                self._meta[base + SCALE_SUFFIX] = (scale_shape(spec.shape, self.quant.block), torch.float32)
            else:
                self._meta[name] = (spec.shape, dtype)
        self._pending: dict[str, torch.Tensor] = {}  # a quantized weight's scales, until the loader asks

    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def read(self, name: str, device: torch.device) -> torch.Tensor:
        if name in self._pending:
            return self._pending.pop(name)
        spec = self.specs[name]
        if spec.kind == "copy":
            return self._draw(spec.source, self.specs[spec.source], device)
        dense = self._draw(name, spec, device)
        if self._meta[name][1] != FP8:
            return dense
        assert self.quant is not None
        q, scale = quantize(dense, self.quant.block)
        self._pending[name.removesuffix("weight") + SCALE_SUFFIX] = scale
        return q

    def _draw(self, name: str, spec: WeightSpec, device: torch.device) -> torch.Tensor:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        if spec.kind == "log_uniform":
            u = torch.rand(spec.shape, generator=gen, device=device)
            return torch.log(spec.low + (spec.high - spec.low) * u).to(self.compute_dtype)
        x = torch.randn(spec.shape, generator=gen, device=device).mul_(spec.std).add_(spec.offset)
        return x.to(self.compute_dtype)


def open_source(path: Path, cfg: ModelConfig, load_format: str, seed: int, dtype: torch.dtype) -> WeightSource:
    """The source ``load_format`` names: ``auto`` / ``safetensors`` the folder's files, ``dummy`` random
    weights of the config's shapes."""
    if load_format == "dummy":
        return DummyWeights(cfg, seed, dtype)
    if load_format in ("auto", "safetensors"):
        return SafetensorsFiles(path)
    raise ValueError(f"load_format: unknown {load_format!r}; expected one of auto, safetensors, dummy")
