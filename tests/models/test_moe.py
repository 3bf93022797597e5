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


def test_a_gpt_oss_checkpoint_with_mxfp4_experts(tmp_path):
    """The released gpt-oss checkpoints' experts: MXFP4 `*_blocks` / `*_scales` (rows are outputs,
    gate and up interleaved), loaded packed; the tokens and prompt logprobs of transformers running
    the same weights dequantized (int16 activations: the float product within rounding)."""
    import gguf
    import numpy as np

    def gguf_to_hf(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """GGUF's MXFP4 blocks (byte j: weights j and j + 16) as gpt-oss's (weights 2j and 2j + 1)."""
        blocks = raw.reshape(n, k // 32, 17)
        weights = np.concatenate([blocks[..., 1:] & 0xF, blocks[..., 1:] >> 4], axis=-1)
        return np.ascontiguousarray(weights[..., 0::2] | (weights[..., 1::2] << 4)), np.ascontiguousarray(blocks[..., 0])

    folder = make_tiny_model(tmp_path / "float", "gpt-oss")
    tensors = load_file(folder / "model.safetensors")
    quantized = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors[name].transpose(1, 2).contiguous()          # [E, out, in]
        e, n, k = rows.shape
        raw = gguf.quants.quantize(rows.reshape(e * n, k).numpy(), gguf.GGMLQuantizationType.MXFP4)
        dequantized = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(e, n, k)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(dequantized.transpose(0, 2, 1)))
        blocks, scales = gguf_to_hf(raw, e * n, k)
        del quantized[name]
        quantized[name + "_blocks"] = torch.from_numpy(blocks.reshape(e, n, k // 32, 16))
        quantized[name + "_scales"] = torch.from_numpy(scales.reshape(e, n, k // 32))
    save_file(tensors, folder / "model.safetensors")             # the reference: dequantized floats
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (packed / f.name).write_bytes(f.read_bytes())
    save_file(quantized, packed / "model.safetensors")
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))

    engine = engine_for(packed, cpu_int8_activations="off")
    experts = engine.model.model.layers[0].mlp.experts
    assert experts.gate_proj.quantized.format_names == ["MXFP4"]
    hf = load_hf(folder)
    prompts = random_prompts([21, 8], seed=3)
    outs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 10)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
        for i in range(1, len(p)):
            assert abs(o.prompt_logprobs[i][p[i]].logprob - ref[i - 1, p[i]].item()) < 1e-3
