"""Context parallelism (``context_parallel_size=2``): a long step's rows split over two real processes
talking gloo on loopback, every answer bitwise that of one rank.

Each engine with two ranks starts a real worker process (the same loading code, the same checkpoint),
so the tests build few of them: dense (Llama, Qwen3 in bfloat16) and sparse attention (GLM-5).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from functools import partial
from pathlib import Path

import pytest
from openai import OpenAI

from conftest import _made
from kvwarden import LLM, SamplingParams
from kvwarden.bench.properties import check_properties, compare
from kvwarden.config import ParallelConfig
from kvwarden.engine.context_parallel.shares import split_entries
from kvwarden.engine.model_runner import BatchEntry
from kvwarden.models.bundled import documents
from server_util import running_server
from util import probe_arms_agree

BLOCK = 16
MIN_TOKENS = 32  # small enough that the tests' prompts are split, not only their decode steps synced


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _children(pid: int) -> set[int]:
    """Child pids of ``pid`` (Linux /proc)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_shares_are_contiguous_chunks_that_cover_the_step() -> None:
    entries = [
        BatchEntry("a", list(range(100)), 40, [1, 2, 3, 4, 5, 6, 7, 8, 9]),
        BatchEntry("b", [7], 12, [10]),
        BatchEntry("c", list(range(33)), 0, [11, 12, 13]),
    ]
    for world in (2, 3, 4):
        shares = split_entries(entries, world)
        sizes = [sum(len(e.token_ids) for e in s) for s in shares]
        assert sum(sizes) == 134 and max(sizes) - min(sizes) <= 1
        # concatenated in rank order, the shares are the step's rows in order, each piece a chunk of its request
        rows = [(e.request_id, e.start + i, t) for s in shares for e in s for i, t in enumerate(e.token_ids)]
        assert rows == [(e.request_id, e.start + i, t) for e in entries for i, t in enumerate(e.token_ids)]
        tables = {e.request_id: e.block_ids for e in entries}
        assert all(e.block_ids == tables[e.request_id] for s in shares for e in s)


@pytest.mark.parametrize(
    ("arch", "dtype", "layer_split"),
    [
        ("llama", "float32", False),
        ("llama", "float32", True),
        ("qwen3", "bfloat16", True),
        ("glm_moe_dsa", "float32", False),
        ("glm_moe_dsa", "float32", True),
    ],
    ids=lambda v: {True: "split", False: "copies"}.get(v, v) if isinstance(v, bool) else v,
)
def test_two_ranks_answer_as_one_bitwise(models_root: Path, arch: str, dtype: str, layer_split: bool) -> None:
    """Greedy and seeded requests, a batch of long and short prompts, then a follow-up whose prefix hit
    covers blocks written during decode: all bitwise. Without the layer split each rank holds a full copy
    (decode steps' K/V copied to the worker); with it each holds half the layers and broadcasts them."""
    model = str(_made(models_root, arch, "tiny"))
    prompts = [_prompt(1, 300), _prompt(2, 40), _prompt(3, 170)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, prompt_logprobs=3),
        SamplingParams(temperature=0.9, seed=7, max_tokens=10, logprobs=5),
        SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=10, logprobs=5),
    ]
    kw = {"dtype": dtype, "device": "cpu", "block_size": BLOCK, "max_num_batched_tokens": 256}

    def run(llm: LLM) -> list:
        first = llm.generate(prompts, params)
        follow = prompts[0] + first[0].token_ids + _prompt(4, 60)
        second = llm.generate([follow], params[1])
        return [*first, *second]

    one = run(LLM(model, **kw))
    cp = {"context_parallel_size": 2, "context_parallel_min_tokens": MIN_TOKENS, "layer_split": layer_split}
    with LLM(model, **cp, **kw) as llm:
        two = run(llm)
        split = llm.engine.stats()["context_parallel_split_steps"]
    assert split >= 2  # the 300- and 170-token prompts were split, not run on rank 0 alone
    assert two[-1].num_cached_tokens > len(prompts[0])  # a block holding decode-written K/V was hit
    for a, b in zip(one, two, strict=True):
        assert compare(a, b).identical, (arch, a.request_id)
        assert a.prompt_logprobs == b.prompt_logprobs


def test_properties_with_two_ranks_equal_the_single_rank_reference(llama_tiny: Path) -> None:
    """(b) a warm repeat, (e) other step budgets, (f) partners joining, (i) a multi-turn follow-up: each run
    on two ranks, each against one rank's cold answer."""
    prompt = _prompt(5, 150)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
    kw = {"device": "cpu", "block_size": BLOCK}
    reference = LLM(str(llama_tiny), enable_prefix_caching=False, **kw).generate([prompt], params)[0]
    make = partial(LLM, str(llama_tiny), context_parallel_size=2, context_parallel_min_tokens=MIN_TOKENS, **kw)
    report = check_properties(
        make, prompt, params, BLOCK, [_prompt(6, 70), _prompt(7, 90)], ("b", "e", "f", "i"), reference
    )
    assert report.all_identical, report.failures()


def test_the_layer_split_holds_a_share_of_the_layers_and_its_wait_keeps_the_answer(llama_small: Path) -> None:
    """Each rank stores half of the layers (twice the prefix-cache capacity in the same memory); with every
    broadcast 30 ms late, the wait keeps the answer bitwise and the unsafe read (no wait) changes it.

    Four layers, so a layer's buffer last held another layer's context (with two layers and two buffers, a
    stale buffer holds the same layer's rows of the previous step, which a racing read cannot tell apart).
    """
    prompts = [_prompt(10, 200), _prompt(11, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5)
    kw = {"device": "cpu", "block_size": BLOCK, "kv_cache_memory": 8 << 20}
    single = LLM(str(llama_small), **kw)
    want = single.generate(prompts, params)
    full = single.engine.stats()
    cp = {"context_parallel_size": 2, "context_parallel_min_tokens": MIN_TOKENS, "layer_split": True}
    answers = {}
    for unsafe in (False, True):
        with LLM(str(llama_small), unsafe_layer_split=unsafe, layer_split_delay_ms=30, **cp, **kw) as llm:
            got = llm.generate(prompts, params)
            answers[unsafe] = [compare(a, b).identical for a, b in zip(want, got, strict=True)]
            stats = llm.engine.stats()
            kv = llm.engine.runner.kv_caches
            slots = [kv.raw(i)[0].shape[0] for i in range(len(kv))]
    assert answers[False] == [True, True]
    assert not all(answers[True])  # the race on demand: the tests catch it
    assert slots[1::2] == [0, 0] and min(slots[0::2]) > 0  # rank 0 stores layers 0 and 2 only
    # the same memory per rank holds twice the tokens
    assert stats["kv_cache_bytes_per_rank"] == [stats["kv_cache_bytes"]] * 2
    assert stats["kv_cache_bytes"] <= full["kv_cache_bytes"]
    assert stats["prefix_cache_capacity_tokens"] >= 1.8 * full["prefix_cache_capacity_tokens"]
    assert stats["layer_split_buffer_bytes"] > 0  # the two view buffers, on top of the owned layers


def test_what_cannot_be_split_is_refused_by_name(models_root: Path, llama_tiny: Path) -> None:
    hybrid = str(_made(models_root, "qwen3_next", "tiny"))
    with pytest.raises(ValueError, match="context_parallel_size: the model has recurrent layers"):
        LLM(hybrid, device="cpu", context_parallel_size=2)
    with pytest.raises(ValueError, match="context_parallel_size: not supported with the host tier"):
        LLM(str(llama_tiny), device="cpu", context_parallel_size=2, host_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="context_parallel_min_tokens: must be an integer >= context_parallel_size"):
        ParallelConfig(4, 2)
    with pytest.raises(ValueError, match="context_parallel_size: must be an integer >= 1"):
        ParallelConfig(0)
    with pytest.raises(ValueError, match="layer_split: needs context_parallel_size >= 2"):
        ParallelConfig(1, layer_split=True)
    with pytest.raises(ValueError, match="unsafe_layer_split / layer_split_delay_ms: need layer_split"):
        ParallelConfig(2, unsafe_layer_split=True)


def test_a_dead_worker_fails_the_step_with_its_name(llama_tiny: Path) -> None:
    """A worker killed between steps: the next split step raises naming the rank (no hang), and close() ends."""
    llm = LLM(str(llama_tiny), device="cpu", context_parallel_size=2, context_parallel_min_tokens=MIN_TOKENS)
    worker = llm.engine.parallel.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    with pytest.raises(RuntimeError, match="context-parallel rank 1 exited"):
        llm.generate([_prompt(8, 120)], SamplingParams(max_tokens=2))
    # the ranks may stand at different collectives now: the group is not reused, every later step says why
    with pytest.raises(RuntimeError, match=r"rank 1 exited.*ranks are stopped; build a new engine"):
        llm.engine.parallel.forward([BatchEntry("x", _prompt(9, 40), 0, [0, 1, 2])], split=True)
    llm.close()


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                out.add(target[8:-1])
    return out


def test_the_ranks_listen_on_loopback_only(llama_tiny: Path) -> None:
    """Every socket rank 0 and its worker listen on - the store's (torch's own would listen on every
    interface) and gloo's - is bound to 127.0.0.1."""
    with LLM(str(llama_tiny), device="cpu", context_parallel_size=2) as llm:
        inodes = _socket_inodes(os.getpid()) | _socket_inodes(llm.engine.parallel.workers.procs[0].pid)
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, ours
                    listening.append(fields[1].rsplit(":", 1)[0])
        port = llm.engine.parallel.store.port
    assert len(listening) >= 2  # the store and at least one gloo listener
    loopback = ("0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000")
    assert all(address in loopback for address in listening), (listening, port)


def test_a_server_with_two_ranks_answers_as_one(llama_tiny: Path) -> None:
    """``kvwarden serve --context-parallel-size 2 --layer-split`` through the official client equals one rank
    in-process; /metrics shows each rank's cache; stopping the server ends its worker."""
    prompt = _prompt(9, 200)
    want = LLM(str(llama_tiny), device="cpu").generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0]
    args = ("--device", "cpu", "--context-parallel-size", "2", "--context-parallel-min-tokens", str(MIN_TOKENS))
    args += ("--layer-split",)
    with running_server(str(llama_tiny), *args) as server:
        workers = _children(server.process.pid)
        assert len(workers) == 1
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        got = client.completions.create(model=str(llama_tiny), prompt=prompt, max_tokens=6, temperature=0.0, logprobs=1)
        assert got.choices[0].text == want.text
        assert got.choices[0].logprobs.token_logprobs == want.sampled_logprobs  # the floats, bit for bit
        metrics = server.metrics()
        # llama-tiny's two layers: one per rank, each rank's pool the same size
        assert metrics['kvwarden:kv_cache_bytes_per_rank{rank="1"}'] == metrics["kvwarden:kv_cache_bytes"]
        assert metrics["kvwarden:context_parallel_split_steps_total"] >= 1
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


def test_the_flag_is_checked_by_the_command_line(llama_tiny: Path) -> None:
    from kvwarden.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", str(llama_tiny), "--context-parallel-size", "0"])
    assert exc.value.code == 2


def test_the_probe_catches_the_layer_split_race_and_not_the_wait(llama_small: Path, tmp_path: Path) -> None:
    """Through real servers and ``kvwarden probe``: a two-rank server with the layer split (every broadcast
    30 ms late) answers as a single rank with the wait, and not with ``--unsafe-layer-split``."""
    words = [w for d in documents() for w in d.text.split()]
    a, b = " ".join(words[:150]), " ".join(words[:120] + words[3000:3040])
    split = ["--context-parallel-size", "2", "--context-parallel-min-tokens", str(MIN_TOKENS), "--layer-split"]
    split += ["--inject-fault", "layer-split-delay=30"]
    verdicts = {}
    for unsafe in (False, True):
        scenario = {
            "name": "layer-split-race",
            "max_tokens": 8,
            "ignore_eos": True,
            "requests": {"A": {"prompt": a}, "B": {"prompt": b}},
            "arms": {
                "one": {"server": {"prefix_caching": False}, "steps": [{"request": "B", "repeat": 2}]},
                "split": {
                    "server": {"extra_args": split + (["--unsafe-layer-split"] if unsafe else [])},
                    "steps": [{"request": "A"}, {"request": "B", "repeat": 2}],
                },
            },
            "compare_arms": ["one", "split"],
        }
        verdicts[unsafe] = probe_arms_agree(llama_small, scenario, tmp_path / f"race-{unsafe}")
    assert verdicts == {False: True, True: False}, verdicts
