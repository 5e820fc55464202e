"""Which side is off when kvwarden and transformers disagree on a device: both engines on the CPU and the GPU.

Scores one prompt (float32 log-softmax at every position) with transformers on the CPU and on the device and
with kvwarden on the CPU, on the device, and on the device with sparse MoE routed on the host; prints the
largest |Δ| of every pair and ends with one JSON line.

    kvwarden bench diag_reference --model builtin:granite_hybrid_moe-small
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=24)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from kvwarden import LLM
    from kvwarden.models.sources import resolve_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    for name in args.model:
        path = resolve_model(name)
        rng = random.Random(4)
        prompt = [rng.randrange(3, 1000) for _ in range(args.tokens)]
        got: dict[str, torch.Tensor] = {}
        for dev in ("cpu", args.device):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
            with torch.no_grad():
                got[f"hf-{dev}"] = torch.log_softmax(hf(torch.tensor([prompt], device=dev)).logits[0].float(), -1).cpu()
            del hf
        common = dict(dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=64, cuda_graphs="off")
        got["kv-cpu"] = torch.log_softmax(LLM(str(path), device="cpu", **common).score(prompt).float(), -1).cpu()
        llm = LLM(str(path), device=args.device, **common)
        got[f"kv-{args.device}"] = torch.log_softmax(llm.score(prompt).float(), -1).cpu()
        llm.engine.runner.model.ops.device_moe = False  # the host's routing and expert walk, device GEMMs
        got[f"kv-{args.device}-host-moe"] = torch.log_softmax(llm.score(prompt).float(), -1).cpu()
        pairs = {f"{a} vs {b}": (got[a] - got[b]).abs().max().item() for a, b in itertools.combinations(got, 2)}
        first = {}
        for a, b in itertools.combinations(got, 2):
            far = ((got[a] - got[b]).abs().amax(-1) > 1e-3).nonzero()
            first[f"{a} vs {b}"] = int(far[0]) if len(far) else -1
        print(f"\n{name}: max |Δ logprob| over {args.tokens} positions (first position > 1e-3)")
        for k, v in pairs.items():
            print(f"  {k:<36} {v:.2e}  ({first[k]})")
        out[name] = {"max": pairs, "first": first}
    print(json.dumps({"bench": "diag_reference", "models": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
