"""Mixture-of-experts specifics beyond the family tests (tests/models/test_families.py): routing
ties, the router's variants, and what the checkpoint must agree with."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import engine_for, hf_greedy, load_hf, make_tiny_model, random_prompts, run_all
from twostep import SamplingParams
from twostep.layers.moe import route


def test_route_variants():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0]])
    w, ids = route(logits, 2, "softmax_topk", renormalise=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 3]] and torch.allclose(w, probs[:, [1, 3]])
    w, _ = route(logits, 2, "softmax_topk", renormalise=True)
    assert torch.allclose(w, torch.tensor([[0.5, 0.5]]))
    w, ids = route(logits, 2, "topk_softmax", renormalise=False)
    assert ids.tolist() == [[1, 3]] and torch.allclose(w, torch.tensor([[0.5, 0.5]]))


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "gpt-oss"])
def test_a_routing_tie_goes_as_in_transformers(tmp_path, arch):
    """Two experts with the same router row (and bias) tie for every token; each expert's own
    weights differ, so which one wins changes the tokens."""
    folder = make_tiny_model(tmp_path / arch, arch)
    tensors = load_file(folder / "model.safetensors")
    router = next(n for n in tensors if n.startswith("model.layers.0.") and n.endswith(("gate.weight", "router.weight")))
    tensors[router][5] = tensors[router][2]
    bias = router.replace("weight", "bias")
    if bias in tensors:
        tensors[bias][5] = tensors[bias][2]
    save_file(tensors, folder / "model.safetensors")
    hf = load_hf(folder)
    prompts = random_prompts([19, 6], seed=7)
    outs = run_all(engine_for(folder), prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 10)


def test_a_config_whose_expert_count_disagrees_with_the_checkpoint_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "qwen3-moe")
    config = json.loads((folder / "config.json").read_text())
    config["num_local_experts"] = 6
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="experts"):
        engine_for(folder)
