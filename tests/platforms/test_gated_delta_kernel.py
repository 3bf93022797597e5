"""A Gated DeltaNet layer's decode step as one C++ call (twostep/kernels/csrc/gated_delta.cpp) against
a PyTorch reference written out here from the math (which is checked against HF transformers'
Qwen3.5 functions), over several consecutive steps in float32 and bf16: the output, the conv state
and the recurrent state, updated in place at the given slots only."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from twostep.platforms.cpu.gated_delta import gated_delta_decode


def kernel_or_skip():
    from twostep.kernels import gated_delta

    kernel = gated_delta()
    if kernel is None:
        pytest.skip("the gated delta kernel cannot be built here (no g++ or ninja); PyTorch answers")
    return kernel


def reference(mixed_qkv, z, a, b, conv_state, recurrent, slots, conv_weight, A_log, dt_bias, norm_weight, eps,
              hk, dk, dv):
    """The decode step in PyTorch, batched over the sequences, rounding to the model's dtype where HF's
    module does; conv_state and recurrent updated in place at `slots`."""
    dtype = mixed_qkv.dtype
    batch, channels = mixed_qkv.shape
    hv = (channels - 2 * hk * dk) // dv
    # 1. the depthwise causal conv over the K-1 previous inputs and this one, then SiLU (each in T)
    window = torch.cat([conv_state[slots], mixed_qkv[:, None]], dim=1)           # [B, K, C], oldest first
    y = F.silu((window.float() * conv_weight.float().t()).sum(1).to(dtype))
    conv_state[slots] = window[:, 1:]
    # 2. q, k L2-normalised per head, q scaled by Dk^-0.5; value heads share key heads in groups
    q, k, v = y.float().split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(batch, hk, dk), k.reshape(batch, hk, dk), v.reshape(batch, hv, dv)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk ** 0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    # 3. the gated delta rule on each value head's state [Dk, Dv]
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.sigmoid().float()
    state = recurrent[slots] * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    o = (state * q[..., None]).sum(-2).to(dtype)
    recurrent[slots] = state
    # 4. the gated RMSNorm per head
    of = o.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    out = (norm_weight * normed) * F.silu(z.reshape(batch, hv, dv).float())
    return out.to(dtype).reshape(batch, hv * dv)


def make_layer(hk, hv, dk, dv, K, n_slots, dtype, seed):
    """A layer's weights and states, random: conv_state, recurrent and the weights as a tuple."""
    g = torch.Generator().manual_seed(seed)
    channels = 2 * hk * dk + hv * dv
    conv_state = torch.randn(n_slots, K - 1, channels, generator=g).to(dtype)
    recurrent = torch.randn(n_slots, hv, dk, dv, generator=g) * 0.1
    conv_weight = (torch.randn(channels, K, generator=g) * 0.5).to(dtype)
    A_log = torch.empty(hv).uniform_(1, 16, generator=g).log()
    dt_bias = torch.randn(hv, generator=g)
    norm_weight = (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype)
    return conv_state, recurrent, (conv_weight, A_log, dt_bias, norm_weight)


def step_inputs(batch, hk, hv, dk, dv, dtype, g):
    """mixed_qkv, z, a, b as views of one projection's output, as a model splits them (rows strided)."""
    channels = 2 * hk * dk + hv * dv
    projected = (torch.randn(batch, channels + hv * dv + 2 * hv, generator=g) * 2).to(dtype)
    return projected.split([channels, hv * dv, hv, hv], dim=-1)


def run_steps(kernel, batch, hk, hv, dk, dv, K, dtype, steps=4, seed=0, eps=1e-6):
    """The kernel and the reference over `steps` consecutive decode steps from the same states; yields
    (got, want) for each step's output and its states after it, and the unused slots' states
    before and after."""
    n_slots = 6
    conv_state, recurrent, weights = make_layer(hk, hv, dk, dv, K, n_slots, dtype, seed)
    slots = torch.tensor([4, 0, 2][:batch], dtype=torch.int64) if batch <= 3 else torch.arange(batch)
    mine = (conv_state.clone(), recurrent.clone())
    theirs = (conv_state.clone(), recurrent.clone())
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        inputs = step_inputs(batch, hk, hv, dk, dv, dtype, g)
        got = kernel.gated_delta_decode(*inputs, *mine, slots, *weights, eps, hk, dk, dv)
        want = reference(*inputs, *theirs, slots, *weights, eps, hk, dk, dv)
        yield (got, *mine), (want, *theirs)
    unused = torch.ones(n_slots, dtype=torch.bool)
    unused[slots] = False
    assert torch.equal(mine[0][unused], conv_state[unused]) and torch.equal(mine[1][unused], recurrent[unused])


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dim", [32, 128])
def test_float32_matches_the_reference_over_steps(batch, dim):
    kernel = kernel_or_skip()
    for got, want in run_steps(kernel, batch, 2, 4, dim, dim, 4, torch.float32, seed=batch + dim):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert got[0].dtype == torch.float32 and got[0].shape == (batch, 4 * dim)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dim", [32, 128])
def test_bf16_matches_the_reference_within_bf16_rounding(batch, dim):
    kernel = kernel_or_skip()
    for (out, conv, rec), (want_out, want_conv, want_rec) in run_steps(kernel, batch, 2, 4, dim, dim, 4,
                                                                       torch.bfloat16, seed=batch + dim):
        assert out.dtype == torch.bfloat16 and conv.dtype == torch.bfloat16
        assert torch.equal(conv, want_conv)                     # the inputs, moved: exact
        # a conv output or the heads' output a bf16 rounding apart (the float32 sums' order) moves
        # what follows by about one bf16 step
        torch.testing.assert_close(out.float(), want_out.float(), rtol=2 ** -6, atol=2 ** -6)
        torch.testing.assert_close(rec, want_rec, rtol=2 ** -6, atol=2 ** -8)
        assert (out.float() == want_out.float()).float().mean() > 0.9      # mostly the same bits


@pytest.mark.parametrize("hk,hv,dk,dv,K", [(1, 3, 24, 40, 4), (2, 2, 20, 12, 3), (1, 2, 16, 8, 2)])
def test_other_sizes_and_conv_widths(hk, hv, dk, dv, K):
    """Head sizes that leave the vector loops' tails, and conv widths other than Qwen's 4."""
    kernel = kernel_or_skip()
    for got, want in run_steps(kernel, 3, hk, hv, dk, dv, K, torch.float32, steps=3, seed=dk + dv + K):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_hf_transformers_qwen3_5_decode_step(dtype):
    """The reference above against HF's causal_conv1d_update, torch_recurrent_gated_delta_rule and
    Qwen3_5RMSNormGated (its conv state is channel-major: [B, C, K-1])."""
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    hk, hv, dk, dv, K, eps = 2, 4, 32, 32, 4, 1e-6
    conv_state, recurrent, weights = make_layer(hk, hv, dk, dv, K, 4, dtype, 5)
    conv_weight, A_log, dt_bias, norm_weight = weights
    slots = torch.tensor([3, 1])
    mixed_qkv, z, a, b = step_inputs(2, hk, hv, dk, dv, dtype, torch.Generator().manual_seed(6))
    want_conv, want_rec = conv_state.clone(), recurrent.clone()
    want = reference(mixed_qkv, z, a, b, want_conv, want_rec, slots, *weights, eps, hk, dk, dv)

    hf_conv = conv_state[slots].transpose(1, 2).contiguous()
    y = hf.causal_conv1d_update(mixed_qkv[:, :, None], hf_conv, conv_weight, None, "silu")[:, :, 0]
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    o, state = hf.torch_recurrent_gated_delta_rule(
        q.reshape(2, 1, hk, dk), k.reshape(2, 1, hk, dk), v.reshape(2, 1, hv, dv), g=g[:, None],
        beta=b.sigmoid()[:, None], initial_state=recurrent[slots], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    norm = hf.Qwen3_5RMSNormGated(dv, eps=eps).to(dtype)
    norm.weight.data = norm_weight
    with torch.no_grad():
        out = norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(2, -1)
    assert torch.equal(hf_conv.transpose(1, 2), want_conv[slots])
    torch.testing.assert_close(state, want_rec[slots], rtol=1e-6, atol=1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:                                # q / sqrt(Dk) there, a product here: a bf16 rounding may move
        torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)


def test_the_registered_op_is_the_python_entry_and_threads_do_not_change_the_bits():
    kernel = kernel_or_skip()
    hk, hv, dk, dv = 2, 4, 32, 32
    conv_state, recurrent, weights = make_layer(hk, hv, dk, dv, 4, 4, torch.float32, 9)
    inputs = step_inputs(3, hk, hv, dk, dv, torch.float32, torch.Generator().manual_seed(10))
    slots = torch.tensor([1, 3, 0])
    results = []
    threads = torch.get_num_threads()
    for fn, n in ((kernel.gated_delta_decode, threads), (torch.ops.twostep.gated_delta_decode, threads),
                  (kernel.gated_delta_decode, 1)):
        states = (conv_state.clone(), recurrent.clone())
        torch.set_num_threads(n)
        try:
            results.append((fn(*inputs, *states, slots, *weights, 1e-6, hk, dk, dv), *states))
        finally:
            torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other, strict=True))


def test_bad_slots_are_refused():
    kernel = kernel_or_skip()
    hk, hv, dk, dv = 1, 1, 8, 8
    conv_state, recurrent, weights = make_layer(hk, hv, dk, dv, 4, 3, torch.float32, 11)
    inputs = step_inputs(2, hk, hv, dk, dv, torch.float32, torch.Generator().manual_seed(12))
    for slots, message in (([1, 1], "distinct"), ([0, 3], "out of range")):
        with pytest.raises(RuntimeError, match=message):
            kernel.gated_delta_decode(*inputs, conv_state, recurrent, torch.tensor(slots), *weights, 1e-6, hk, dk, dv)


def test_the_cpu_platform_offers_the_kernel_for_float32_and_bf16_only():
    from twostep.platforms.cpu import CpuPlatform
    from twostep.platforms.interface import Platform

    kernel = kernel_or_skip()
    cpu = CpuPlatform(torch.device("cpu"))
    assert cpu.gated_delta_decode(torch.float32) is kernel.gated_delta_decode
    assert cpu.gated_delta_decode(torch.bfloat16) is kernel.gated_delta_decode
    assert cpu.gated_delta_decode(torch.float16) is None
    assert gated_delta_decode(None, torch.float32) is None                   # where it does not build
    assert Platform(torch.device("cpu")).gated_delta_decode(torch.float32) is None
