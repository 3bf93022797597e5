"""The gated delta rule's chunked form (prompt chunks) against the plain recurrence, token by token
in float64, and the recurrent step (decodes) likewise: float32 within 1e-5, over chunk boundaries,
from a state carried in, with grouped value heads' strong and weak decays."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from twostep.layers.gated_delta_rule import chunked, recurrent_step


def _inputs(t: int, heads: int = 4, dk: int = 16, dv: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(t, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(t, heads, dk, generator=g), dim=-1)
    v = torch.randn(t, heads, dv, generator=g)
    decay = torch.tensor([0.02, 0.5, 4.0, 16.0])[:heads]           # from slow to complete forgetting
    gate = -decay * F.softplus(torch.randn(t, heads, generator=g) + 1.0)
    beta = torch.sigmoid(2 * torch.randn(t, heads, generator=g))
    state = torch.randn(heads, dk, dv, generator=g)
    return q, k, v, gate, beta, state


def _reference(q, k, v, gate, beta, state):
    """The recurrence as written (layers/gated_delta_rule.py's docstring), float64."""
    s = state.double().clone()
    out = []
    for t in range(q.shape[0]):
        s = s * gate[t].double().exp()[:, None, None]
        u = (v[t].double() - torch.einsum("hkv,hk->hv", s, k[t].double())) * beta[t].double()[:, None]
        s = s + k[t].double()[:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t].double()))
    return torch.stack(out), s


@pytest.mark.parametrize("t", [1, 5, 64, 150])
def test_chunked_equals_the_recurrence(t):
    q, k, v, gate, beta, state = _inputs(t)
    ref_out, ref_state = _reference(q, k, v, gate, beta, state)
    s = state.clone()
    out = chunked(q, k, v, gate, beta, s)
    assert (out.double() - ref_out).abs().max() < 1e-5
    assert (s.double() - ref_state).abs().max() < 1e-5


def test_chunked_prefill_split_anywhere_carries_the_state():
    q, k, v, gate, beta, state = _inputs(100, seed=3)
    ref_out, ref_state = _reference(q, k, v, gate, beta, state)
    s, outs = state.clone(), []
    for a, b in [(0, 1), (1, 4), (4, 11), (11, 77), (77, 100)]:
        outs.append(chunked(q[a:b], k[a:b], v[a:b], gate[a:b], beta[a:b], s))
    assert (torch.cat(outs).double() - ref_out).abs().max() < 1e-5
    assert (s.double() - ref_state).abs().max() < 1e-5


def test_recurrent_step_over_a_batch_updates_each_state_in_place():
    seqs = [_inputs(6, seed=i) for i in range(3)]
    states = torch.stack([s[-1] for s in seqs])
    refs = [_reference(*s) for s in seqs]
    for t in range(6):
        o = recurrent_step(*(torch.stack([s[j][t] for s in seqs]) for j in range(5)), states)
        for b, (ref_out, _) in enumerate(refs):
            assert (o[b].double() - ref_out[t]).abs().max() < 1e-5
    for b, (_, ref_state) in enumerate(refs):
        assert (states[b].double() - ref_state).abs().max() < 1e-5
