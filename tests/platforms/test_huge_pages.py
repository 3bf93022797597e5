"""The weights a decode step streams live in memory advised for 2 MiB pages (platforms/cpu/huge_pages.py):
copies exact, in mappings the kernel marks eligible for transparent huge pages, the quantized and
bf16 paths both placed (a tied embedding with its head), the same tokens either way."""
from __future__ import annotations

import pytest
import torch

from twostep.config import EngineConfig
from twostep.engine.llm_engine import LLMEngine
from twostep.layers.linear import Linear
from twostep.platforms.cpu.huge_pages import HUGE_PAGE, HugePageArena, thp_setting

from conftest import GREEDY, random_prompts, run_all

needs_thp = pytest.mark.skipif(not HugePageArena.available(),
                               reason=f"transparent huge pages here: {thp_setting()} (needs madvise or always)")


def advised_huge(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte was advised MADV_HUGEPAGE (VmFlags "hg" in
    /proc/self/smaps) and the kernel may back it with huge pages (THPeligible). Whether ordinary
    memory is advised is not this code's to say: under "always" all of it is eligible, and other
    libraries in a process may advise the heap (a full test run's [heap] was, by whom unknown)."""
    address, inside, eligible = t.data_ptr(), False, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "THPeligible:":
                eligible = line.split()[1] == "1"
            elif inside and head == "VmFlags:":
                return eligible and "hg" in line.split()[1:]
    return False


@needs_thp
def test_a_placed_tensor_is_an_exact_copy_in_huge_page_memory():
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE)
    tensors = [torch.randn(300, 7), torch.randint(0, 255, (5 * HUGE_PAGE,), dtype=torch.uint8),
               torch.randn(64, 64).bfloat16().t(), torch.arange(3, dtype=torch.float16)]
    placed = [arena.place(t) for t in tensors]
    for t, p in zip(tensors, placed):
        assert torch.equal(p, t) and p.dtype == t.dtype and p.is_contiguous()
        assert p.data_ptr() != t.data_ptr() and arena.holds(p) and not arena.holds(t)
        assert p.data_ptr() % 64 == 0 and advised_huge(p)
    assert len(arena._chunks) == 3        # the 10 MiB tensor took a chunk of its own; the rest filled the others
    assert all(c.data_ptr() % HUGE_PAGE == 0 for c in arena._chunks)
    assert arena.place(placed[0]) is placed[0] and arena.place(None) is None
    assert arena.placed_bytes == sum(t.numel() * t.element_size() for t in tensors)
    placed[0].add_(1)                      # writable, and the original untouched
    assert torch.equal(placed[0], tensors[0] + 1)


def streamed_tensors(engine: LLMEngine) -> list[torch.Tensor]:
    """What a decode step's matrix-vector products read: quantized planes or row-major weights."""
    out = []
    for m in engine.model.modules():
        if isinstance(m, Linear):
            if m.quantized is not None:
                out += [t for part in m.quantized.parts for t in part.planes() if t is not None]
            elif getattr(m, "row_major_weight", None) is not None:
                out.append(m.row_major_weight)
    return out


@needs_thp
@pytest.mark.parametrize("dtype, quantization", [("float32", "int4"), ("bfloat16", None)])
def test_the_engine_streams_its_weights_from_huge_page_memory(tiny_model_dir, dtype, quantization):
    from twostep import kernels
    from twostep.platforms.cpu.linear import can_prepack

    if quantization and kernels.quant_linear() is None:
        pytest.skip("the quantized kernel needs g++/ninja")
    gemv = kernels.linear_bf16()
    if not quantization and (gemv is None or not gemv.has_bf16_dot() or not can_prepack(torch.bfloat16, torch.device("cpu"))):
        pytest.skip("the bf16 matrix-vector kernel needs g++/ninja and an AVX512-BF16 CPU")
    folder = tiny_model_dir("qwen2")                 # tied embeddings
    engines = [LLMEngine(EngineConfig(model=str(folder), dtype=dtype, quantization=quantization,
                                      kv_cache_memory="8MiB", cpu_huge_pages=huge)) for huge in (True, False)]
    placed, plain = (streamed_tensors(e) for e in engines)
    assert placed and len(placed) == len(plain)
    arena = engines[0].platform.arena
    assert all(arena.holds(t) and advised_huge(t) for t in placed)
    assert engines[1].platform.arena is None and not any(arena.holds(t) for t in plain)
    if quantization is None:
        model = engines[0].model          # the tied head's row-major weight is the embedding's table
        assert model.lm_head.row_major_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompts = random_prompts(seed=3)
    tokens = [[o.outputs[0].token_ids for o in run_all(e, prompts, GREEDY)] for e in engines]
    assert tokens[0] == tokens[1] and all(tokens[0])


def test_without_huge_pages_the_log_says_so(tiny_model_dir, caplog, monkeypatch):
    import twostep.platforms.cpu.huge_pages as huge_pages

    monkeypatch.setattr(huge_pages, "THP_SETTING", "/nonexistent")
    with caplog.at_level("INFO"):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("qwen2")), dtype="float32", quantization="int4",
                                        kv_cache_memory="8MiB"))
    assert engine.platform.arena is None
    assert "weights in 4 KiB pages (transparent huge pages: unavailable)" in caplog.text


@needs_thp
def test_a_second_model_on_the_platform_logs_its_own_bytes(tiny_model_dir, caplog):
    """A draft model binds on its target's platform (one arena): its log line counts its weights only."""
    from twostep import kernels
    from twostep.platforms.cpu.linear import can_prepack

    gemv = kernels.linear_bf16()
    if gemv is None or not gemv.has_bf16_dot() or not can_prepack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("the bf16 matrix-vector kernel needs g++/ninja and an AVX512-BF16 CPU")
    folder = str(tiny_model_dir("qwen2"))
    spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": 2}
    with caplog.at_level("INFO"):
        engine = LLMEngine(EngineConfig(model=folder, dtype="bfloat16", kv_cache_memory="8MiB",
                                        speculative_config=spec))
    lines = [r.getMessage() for r in caplog.records if "advised for 2 MiB pages" in r.getMessage()]
    assert len(lines) == 2 and lines[0] == lines[1], lines      # the same weights twice, not twice as many
    assert engine.platform.placed_bytes() > 0
