"""Speculative decoding with the checkpoint's own multi-token-prediction layer (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next): tiny hybrids over 8 tokens (drafts often right, often wrong) with random mtp.* tensors
added to their safetensors, in the file itself or a second shard. The layer's output equals one built
from transformers' blocks; greedy output is token-identical to decoding without speculation, under
chunked prompts, preemption and prefix hits; seeded sampling repeats; every block of the target's
and of the layer's cache is free after each run."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import engine_for, load_hf, make_tiny_model, random_prompts, run_all

from twostep import SamplingParams
from twostep.config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 0, 6, 6, 2, 5, 7, 1, 3], [3, 5, 1, 6] * 4, [6]]


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def add_mtp(folder: Path, seed: int = 0, shard: bool = False) -> Path:
    """Random mtp.* tensors (vLLM's and llama.cpp's names): fc [H, 2H], its two input norms, the final
    norm, and a full-attention layer shaped as the model's layer 1 (a full-attention one); in
    model.safetensors, or with shard in mtp.safetensors and an index over both files."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    tensors = load_file(folder / "model.safetensors")
    h = tensors["model.norm.weight"].shape[0]
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    shapes |= {"mtp.layers.0." + n.removeprefix("model.layers.1."): tuple(t.shape)
               for n, t in tensors.items() if n.startswith("model.layers.1.")}
    layer = {n: torch.randn(s, generator=g) * 0.1 for n, s in shapes.items()}
    if shard:
        save_file(layer, folder / "mtp.safetensors", metadata={"format": "pt"})
        weight_map = {n: "model.safetensors" for n in tensors} | {n: "mtp.safetensors" for n in layer}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(tensors | layer, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(arch, with_mtp=True) -> a tiny hybrid over 8 tokens; the MoE one's MTP layer in a second shard."""
    root = tmp_path_factory.mktemp("mtp")

    def get(arch: str, with_mtp: bool = True) -> Path:
        plain = root / arch
        if not plain.exists():
            make_tiny_model(plain, arch, vocab_size=8)
        if not with_mtp:
            return plain
        folder = root / f"{arch}-mtp"
        if not folder.exists():
            shutil.copytree(plain, folder)
            add_mtp(folder, shard=arch != "qwen3.5")
        return folder
    return get


def spec_counts(engine) -> tuple[int, int]:
    stats = engine.get_stats()
    return stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]


def assert_layer_cache_free(engine) -> None:
    kv = engine.proposer.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, "the MTP layer's blocks leaked"
    assert not engine.proposer._seqs, "the MTP proposer still holds requests"


def same_tokens(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids


# ---- the layer's math ------------------------------------------------------------------------

def reference_layer(hf, folder: Path, after: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The MTP layer over rows 0..n-1 from transformers' blocks: the model's full-attention layer 1
    with the mtp.layers.0 weights, fc and the (1 + w) norms; after: the token after each row,
    hidden [n, H] each row's hidden input. Its output after the final norm, [n, H]."""
    from safetensors import safe_open
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    weights = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            weights |= {k: s.get_tensor(k) for k in s.keys() if k.startswith("mtp.")}

    def norm(name):
        n = Qwen3_5RMSNorm(hf.config.hidden_size, eps=hf.config.rms_norm_eps)
        n.weight.data.copy_(weights[f"mtp.{name}.weight"])
        return n

    layer = copy.deepcopy(hf.model.layers[1])
    layer.load_state_dict({n.removeprefix("mtp.layers.0."): t for n, t in weights.items()
                           if n.startswith("mtp.layers.0.")})
    n = len(after)
    with torch.no_grad():
        e = norm("pre_fc_norm_embedding")(hf.model.embed_tokens(torch.tensor([after])))
        x = F.linear(torch.cat([e, norm("pre_fc_norm_hidden")(hidden[None])], -1), weights["mtp.fc.weight"])
        rope = hf.model.rotary_emb(x, torch.arange(n).view(1, 1, -1).expand(3, 1, -1))
        x = layer(x, position_embeddings=rope, attention_mask=None, position_ids=torch.arange(n)[None])
        return norm("norm")(x)[0]


def reference_drafts(hf, folder: Path, tokens: list[int], k: int) -> list[int]:
    """Greedy drafts after `tokens`: the layer over the target's hidden states of every position
    but the newest, then k - 1 rows fed the layer's own output and the draft before."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
    after, drafts = list(tokens[1:]), []
    for _ in range(k):
        out = reference_layer(hf, folder, after, hidden)
        with torch.no_grad():
            drafts.append(int(hf.lm_head(out[-1]).argmax()))
        after.append(drafts[-1])
        hidden = torch.cat([hidden, out[-1:]])
    return drafts


def test_the_layer_and_its_drafts_match_transformers_blocks(models):
    """Over prompt chunks of 5 (the layer's rows over several forwards, reading its own cache) and
    verification steps: each row's output equals the reference's, and every proposal's 3 drafts are
    the reference's greedy chain."""
    folder = models("qwen3.5")
    hf = load_hf(folder)
    prompt = [1, 4, 0, 6, 6, 2, 5, 7, 1, 3, 2, 2, 5]
    engine = engine_for(folder, block_size=4, max_num_batched_tokens=5, speculative_config=mtp(3))
    rid = engine.add_request(prompt, GREEDY)
    checked = 0
    for _ in range(8):
        engine.step()
        request, seq = engine.scheduler.requests[rid], engine.proposer._seqs[rid]
        tokens = request.all_token_ids
        with torch.no_grad():
            hidden = hf.model(torch.tensor([tokens[:seq.rows]])).last_hidden_state[0]
        out = reference_layer(hf, folder, tokens[1:seq.rows + 1], hidden)
        assert torch.allclose(out[-1], seq.last, atol=1e-5), (seq.rows, (out[-1] - seq.last).abs().max())
        if request.spec_token_ids:
            assert request.spec_token_ids == reference_drafts(hf, folder, tokens, 3)
            checked += 1
    assert checked >= 3


# ---- lossless, inside the engine -------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3.5", "qwen3.5-moe"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_token_identical(models, arch, k):
    folder = models(arch)
    plain = run_all(engine_for(folder, block_size=4), PROMPTS, GREEDY)
    spec = engine_for(folder, block_size=4, speculative_config=mtp(k))
    same_tokens(plain, run_all(spec, PROMPTS, GREEDY))
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted, "drafts were meant to be partly accepted, partly rejected"
    assert spec.proposer.num_blind == 0
    assert_layer_cache_free(spec)


def test_qwen3_next_is_token_identical_under_prompt_chunks(models):
    folder = models("qwen3-next")
    plain = run_all(engine_for(folder, block_size=4), PROMPTS, GREEDY)
    spec = engine_for(folder, block_size=4, max_num_batched_tokens=7, speculative_config=mtp(2))
    same_tokens(plain, run_all(spec, PROMPTS, GREEDY))
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted
    assert_layer_cache_free(spec)


def test_seeded_sampling_repeats(models):
    folder = models("qwen3.5")
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        spec = engine_for(folder, block_size=4, speculative_config=mtp(2))
        runs.append(run_all(spec, PROMPTS, params))
        drafted, accepted = spec_counts(spec)
        assert 0 < accepted < drafted
        assert_layer_cache_free(spec)
    same_tokens(*runs)


def test_greedy_is_token_identical_under_preemption_with_prefix_caching(models):
    """A cache too small for the batch (requests preempted and recomputed, their layer rows too),
    prefix caching on, prompt chunks of 16."""
    folder = models("qwen3.5-moe")
    prompts = random_prompts([40, 2, 17, 33, 5, 26], seed=7, vocab=8)
    plain = run_all(engine_for(folder, block_size=4, enable_prefix_caching=False), prompts, GREEDY)
    spec = engine_for(folder, block_size=4, max_num_batched_tokens=16, num_kv_blocks=24, speculative_config=mtp(3))
    same_tokens(plain, run_all(spec, prompts, GREEDY))
    assert spec.scheduler.num_preemptions > 0, "the cache was meant to be too small for the batch"
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted
    assert_layer_cache_free(spec)


def test_prefix_hits_find_the_layers_rows_too(models):
    """A repeated prompt and a chat's next turn skip the cached blocks in the target; the layer's
    own prefix cache serves the same rows (its keys: the tokens shifted by one), so they draft."""
    folder = models("qwen3.5")
    first = random_prompts([29], seed=11, vocab=8)[0]
    cold = engine_for(folder, block_size=4, enable_prefix_caching=False)
    warm = engine_for(folder, block_size=4, speculative_config=mtp(2))
    [turn1] = run_all(warm, [first], GREEDY)
    following = [first, first + turn1.outputs[0].token_ids + [5, 6, 7]]
    before = spec_counts(warm)[0]
    outs = run_all(warm, following, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [28, 28], "the repeat and the next turn were meant to hit"
    assert warm.proposer.num_blind == 0, "the layer's cache was meant to hit where the target's did"
    assert spec_counts(warm)[0] > before
    same_tokens(run_all(cold, following, GREEDY), outs)
    assert_layer_cache_free(warm)


# ---- what is refused ---------------------------------------------------------------------------

def test_a_checkpoint_without_mtp_weights_is_refused(models, tiny_model_dir):
    with pytest.raises(ValueError, match="no MTP weights"):
        engine_for(models("qwen3.5", with_mtp=False), speculative_config=mtp(2))
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        engine_for(tiny_model_dir("llama"), speculative_config=mtp(2))


def test_config_takes_mtp_without_a_model():
    c = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}')
    assert (c.method, c.num_speculative_tokens, c.model) == ("mtp", 2, None)
    with pytest.raises(ValueError, match="takes no"):
        SpeculativeConfig.parse({"method": "mtp", "model": "x"})
