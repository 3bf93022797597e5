"""Tensor parallelism on gloo, on this CPU: one model split over two processes against the same model
in one, float32, for every architecture. Greedy tokens must be identical and prompt logprobs within
1e-4 (the sums in a row-parallel matmul are split in two and added, which rounds differently), with
chunked prefill, prefix caching and preemption all on; and a worker that dies is named."""
from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import engine_for, random_prompts
from twostep import SamplingParams
from twostep.core.execution.tp_group import WorkerError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
# mistral: 1 KV head for 2 ranks (replicated); qwen2: q/k/v bias and a tied head; qwen3: q/k norm;
# the MoE ones: experts split along their intermediate size (gpt-oss: sinks per head, expert biases)
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3-moe", "gpt-oss", "qwen2-moe"]


def run(engine, prompts, params=GREEDY):
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.scheduler.kv.check_integrity()
    return [done[i] for i in ids]


def assert_same(got, want, tolerance: float) -> None:
    """Greedy tokens identical, every prompt position's logprobs within tolerance."""
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for token, lp in pb.items():
                assert abs(pa[token].logprob - lp.logprob) < tolerance


def small_cache(**kw):
    # 12 blocks of 16 for 5 prompts of up to 60 + 20 tokens: preemption happens; chunks of 32 tokens
    return dict(num_kv_blocks=12, max_num_batched_tokens=32, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_match_one(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    prompts = random_prompts([5, 17, 33, 60, 60], seed=4)
    prompts[4] = prompts[3][:48] + prompts[4][48:]          # a shared prefix: a prefix-cache hit
    one = engine_for(folder, **small_cache())
    want = run(one, prompts)
    two = engine_for(folder, tensor_parallel_size=2, **small_cache())
    try:
        got = run(two, prompts)
        assert two.get_stats()["num_preemptions"] > 0
        assert two.get_stats()["prefix_cache_hits"] > 0
    finally:
        two.shutdown()
    assert_same(got, want, 1e-4)


def test_each_rank_holds_its_share(tiny_model_dir):
    folder = tiny_model_dir("llama")
    two = engine_for(folder, tensor_parallel_size=2)
    try:
        cfg = two.model.config
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (2, 1, 64)
        assert two.model.lm_head.weight.shape[0] == two.model_config.vocab_size // 2
        assert two.runner.kv_caches[0].values.shape[3] == 1      # one KV head per rank
    finally:
        two.shutdown()


def test_a_dead_worker_is_named(tiny_model_dir):
    folder = tiny_model_dir("llama")
    two = engine_for(folder, tensor_parallel_size=2, distributed_timeout_s=10)
    try:
        run(two, random_prompts([8], seed=1))
        worker = two.tp_group.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {worker.pid}\) died"):
            run(two, random_prompts([8], seed=2))
        assert time.monotonic() - start < 10
    finally:
        two.shutdown()
    assert not two.tp_group


def test_sizes_that_do_not_divide_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        engine_for(tiny_model_dir("llama"), tensor_parallel_size=3)


# ---- the server ---------------------------------------------------------------------------------

def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_the_server_with_two_ranks(tiny_model_dir, tmp_path):
    import openai

    from conftest import MODEL, Server

    folder = tiny_model_dir("qwen2")
    single = engine_for(folder)
    prompt = random_prompts([12], seed=3)[0]
    want = run(single, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    server = Server(folder, tmp_path, "--tensor-parallel-size", "2")
    try:
        workers = children_of(server.proc.pid)
        assert workers, "no worker process"
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="x")
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.outputs[0].text
        assert server.terminate() == 0
    finally:
        server.kill()
    time.sleep(0.5)
    alive = [p for p in workers if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
    assert not alive, f"worker processes left: {alive}"


def test_the_server_exits_when_a_worker_dies(tiny_model_dir, tmp_path):
    import httpx

    from conftest import MODEL, Server

    server = Server(tiny_model_dir("llama"), tmp_path, "--tensor-parallel-size", "2", "--distributed-timeout", "10")
    try:
        (worker,) = [p for p in children_of(server.proc.pid)      # not multiprocessing's resource tracker
                     if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        os.kill(worker, signal.SIGKILL)
        r = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 500 and "rank 1" in r.json()["error"]["message"], r.text
        assert server.proc.wait(20) == 1
        assert "died" in server.output()
    finally:
        server.kill()


def test_a_hung_worker_ends_the_step_within_the_timeout(tiny_model_dir):
    two = engine_for(tiny_model_dir("llama"), tensor_parallel_size=2, distributed_timeout_s=3)
    worker = two.tp_group.procs[0]
    try:
        run(two, random_prompts([8], seed=1))
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="no answer from the other ranks within 3 s"):
            run(two, random_prompts([8], seed=2))
        assert time.monotonic() - start < 3 + 5
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        two.shutdown()
    assert not worker.is_alive()


def test_speculative_decoding_with_two_ranks(tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = run(engine_for(folder), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    two = engine_for(folder, tensor_parallel_size=2, speculative_config=spec)
    try:
        got = run(two, prompts, params)
        assert two.get_stats()["spec_decode_num_draft_tokens"] > 0
    finally:
        two.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights_are_sharded_too(tiny_model_dir, method):
    """--quantization packs the weights at load; each rank keeps its rows / its blocks of columns of
    the packed matrices (never a float copy) and answers as one process does."""
    from twostep.quantization.packed import QuantizedWeight

    folder = tiny_model_dir("qwen3")
    prompts = random_prompts([9, 30], seed=6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    want = run(engine_for(folder, quantization=method), prompts, params)
    two = engine_for(folder, quantization=method, tensor_parallel_size=2)
    try:
        o_proj = two.model.model.layers[0].self_attn.o_proj
        whole = two.model_config.num_heads * two.model_config.head_dim
        assert isinstance(o_proj.quantized, QuantizedWeight) and o_proj.quantized.k == whole // 2
        got = run(two, prompts, params)
    finally:
        two.shutdown()
    assert_same(got, want, 1e-3)


def test_quantized_experts_are_sharded_too(tmp_path):
    """Each rank keeps every expert's packed rows of gate/up and blocks of columns of down (64
    intermediate features: 32 a rank, whole blocks) and answers as one process does."""
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "moe", "qwen3-moe", moe_intermediate_size=64)
    prompts = random_prompts([9, 30], seed=6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    want = run(engine_for(folder, quantization="int8"), prompts, params)
    two = engine_for(folder, quantization="int8", tensor_parallel_size=2)
    try:
        experts = two.model.model.layers[0].mlp.experts
        assert experts.gate_proj.quantized.n == 8 * 32 and experts.down_proj.quantized.k == 32
        got = run(two, prompts, params)
    finally:
        two.shutdown()
    assert_same(got, want, 1e-3)


def test_packed_columns_are_the_dequantized_columns():
    import numpy as np

    from twostep.quantization.packed import PackedFormat, pack

    rng = np.random.default_rng(0)
    for fmt in (PackedFormat(4, 32, True, "Q4_1"), PackedFormat(5, 32, False, "Q5_0"), PackedFormat(6, 16, False, "Q6_K"),
                PackedFormat(8, 32, False, "Q8_0")):
        n, k = 5, 128
        codes = (rng.integers(-128, 128, (n, k)) if fmt.bits == 8 else rng.integers(0, 1 << fmt.bits, (n, k)))
        scales = rng.random((n, k // fmt.group)) + 0.1
        mins = rng.random((n, k // fmt.group)) if fmt.has_min else None
        w = pack(codes, scales, mins, fmt)
        full = w.dequantize()
        assert torch_equal(w.columns(32, 96).dequantize(), full[:, 32:96])
    with pytest.raises(ValueError, match="cannot cut rows at weight 16"):
        w.columns(16, 64)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_ranks_started_from_outside_as_torchrun_does(tiny_model_dir, tmp_path):
    """The same `twostep serve` command twice, with torchrun's variables: rank 0 serves, rank 1
    becomes its worker."""
    import subprocess
    import sys

    from conftest import MODEL, ROOT, Server, free_port

    folder = tiny_model_dir("llama")
    prompt = random_prompts([10], seed=8)[0]
    want = run(engine_for(folder), [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    worker_log = open(tmp_path / "rank1.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "twostep.cli", "serve", "--model", str(folder), "--dtype", "float32",
                               "--kv-cache-memory", "16MiB", "--tensor-parallel-size", "2"], cwd=ROOT,
                              env={**os.environ, **env, "RANK": "1", "LOCAL_RANK": "1"}, stdout=worker_log,
                              stderr=subprocess.STDOUT)
    server = Server(folder, tmp_path, "--tensor-parallel-size", "2", env={**env, "RANK": "0", "LOCAL_RANK": "0"})
    try:
        import httpx

        r = httpx.post(server.base + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert r.json()["choices"][0]["text"] == want.outputs[0].text
        assert "started from outside" in server.output()
        assert server.terminate() == 0
        assert worker.wait(20) == 0
    finally:
        server.kill()
        worker.kill()


def test_a_second_tensor_parallel_llm_in_one_process(tiny_model_dir):
    """A notebook or a script comparing two settings: LLM(tensor_parallel_size=2), del, another one.
    The first's workers and torch.distributed group go with it (dropped, shut down, or closed by
    its with-block), and each gives the same tokens; two alive at once is refused by name."""
    from twostep import LLM

    folder, prompts = str(tiny_model_dir("llama")), random_prompts([5, 17], seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first = LLM(folder, tensor_parallel_size=2, dtype="float32", kv_cache_memory="8MiB")
    want, workers = tokens(first), list(first.llm_engine.tp_group.procs)
    with pytest.raises(RuntimeError, match="another tensor-parallel engine in this process"):
        LLM(folder, tensor_parallel_size=2, dtype="float32", kv_cache_memory="8MiB")
    del first                                       # no shutdown(): dropping it is enough
    second = LLM(folder, tensor_parallel_size=2, dtype="float32", kv_cache_memory="8MiB")
    assert not any(p.is_alive() for p in workers)   # the first's workers are gone
    assert tokens(second) == want
    second.shutdown()
    with LLM(folder, tensor_parallel_size=2, dtype="float32", kv_cache_memory="8MiB") as third:
        assert tokens(third) == want
