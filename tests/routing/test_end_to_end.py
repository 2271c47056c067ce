"""Causality, skip-writes and gradient checks on a pure-PyTorch routed stack."""

import torch
import torch.nn.functional as F

from megatron_triroute.routing.gumbel import soft_gumbel_sample
from megatron_triroute.routing.quant import fake_quantize, relaxed_kv_write
from tests.oracles import reference_attention
from megatron_triroute.routing.side_features import TokenTables, document_positions, word_distances

from .helpers import tiny_config
from .tiny_model import TinyRoutedLM


def _tables(V):
    g = torch.Generator().manual_seed(3)
    return TokenTables(log_prob=torch.log_softmax(torch.randn(V, generator=g), 0),
                       word_start=torch.rand(V, generator=g) < 0.4, eod_id=1)


def test_side_features_hand_values():
    eod = 1
    tokens = torch.tensor([[5, 6, 1, 7, 8, 9, 1, 4]])
    assert document_positions(tokens, eod).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    starts = torch.zeros(10, dtype=torch.bool)
    starts[[6, 9]] = True
    assert word_distances(tokens, starts, eod).tolist() == [[0, 0, 1, 0, 1, 0, 1, 0]]


def test_whole_routed_stack_is_causal():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = TinyRoutedLM(cfg, _tables(cfg.model.vocab_size)).train()
    T, t = cfg.model.seq_len, 6
    tokens = torch.randint(0, cfg.model.vocab_size, (2, T))
    tokens[0, 3] = 1  # an end-of-document inside the prefix
    changed = tokens.clone()
    changed[:, t + 1 :] = torch.randint(0, cfg.model.vocab_size, (2, T - t - 1))
    changed[1, t + 1] = 1  # and one in the changed suffix
    logits_a, outs_a = model(tokens, torch.tensor([0, 1]))
    logits_b, outs_b = model(changed, torch.tensor([0, 1]))
    assert not torch.equal(logits_a[:, t + 1 :], logits_b[:, t + 1 :])
    assert torch.equal(logits_a[:, : t + 1], logits_b[:, : t + 1])
    for a, b in zip(outs_a, outs_b):
        assert torch.equal(a.attn.y[:, : t + 1], b.attn.y[:, : t + 1])
        assert torch.equal(a.bits.y[:, : t + 1], b.bits.y[:, : t + 1])
        assert torch.equal(a.experts.index[:, : t + 1], b.experts.index[:, : t + 1])
        assert torch.equal(a.experts.weight[:, : t + 1], b.experts.weight[:, : t + 1])


def test_lm_loss_reaches_attention_and_bit_heads():
    cfg = tiny_config()
    torch.manual_seed(1)
    model = TinyRoutedLM(cfg, _tables(cfg.model.vocab_size)).train()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    logits, _ = model(tokens, torch.tensor([0, 1]))
    F.cross_entropy(logits[:, :-1].reshape(-1, cfg.model.vocab_size), tokens[:, 1:].reshape(-1)).backward()
    for c in model.controllers:
        assert c.heads["attn"].proj.weight.grad.abs().sum() > 0
        assert c.heads["bits"].proj.weight.grad.abs().sum() > 0
        assert c.heads["experts"].proj.weight.grad.abs().sum() > 0


def test_relaxed_path_gradients_match_finite_differences():
    """d loss / d (attention logits) and d loss / d (bit logits) on the soft relaxation."""
    torch.manual_seed(2)
    B, T, H, H_kv, d = 1, 6, 2, 1, 4
    dt = torch.float64
    q, k, v = (torch.randn(B, T, n, d, dtype=dt) for n in (H, H_kv, H_kv))
    za = torch.randn(B, T, H, 3, dtype=dt, requires_grad=True)
    zb = torch.randn(B, T, 4, dtype=dt, requires_grad=True)
    ga, gb = (-torch.log(-torch.log(torch.rand(s, dtype=dt))) for s in (za.shape, zb.shape))
    w = torch.randn(B, T, H, d, dtype=dt)

    def loss(za_, zb_):
        yb = soft_gumbel_sample(zb_, gb, 0.8)
        kw, vw = relaxed_kv_write(k, yb, (2, 4, 8, 16), 2), relaxed_kv_write(v, yb, (2, 4, 8, 16), 2)
        return (w * reference_attention(q, kw, vw, soft_gumbel_sample(za_, ga, 0.8), 2)).sum()

    grad_a, grad_b = torch.autograd.grad(loss(za, zb), (za, zb))
    assert grad_a.abs().max() > 1e-4 and grad_b.abs().max() > 1e-4
    eps = 1e-6
    for z, grad, other in ((za, grad_a, "a"), (zb, grad_b, "b")):
        flat = z.detach().clone().view(-1)
        for i in range(0, flat.numel(), 5):
            plus, minus = flat.clone(), flat.clone()
            plus[i] += eps
            minus[i] -= eps
            with torch.no_grad():
                if other == "a":
                    fd = (loss(plus.view_as(za), zb) - loss(minus.view_as(za), zb)) / (2 * eps)
                else:
                    fd = (loss(za, plus.view_as(zb)) - loss(za, minus.view_as(zb))) / (2 * eps)
            assert abs(fd.item() - grad.view(-1)[i].item()) < 1e-6, (other, i)


def test_a_skipping_token_is_still_read_at_its_bit_width():
    torch.manual_seed(4)
    B, T, H, d, s = 1, 6, 2, 8, 2  # token s skips attention
    q, k, v = torch.randn(B, T, H, d), torch.randn(B, T, 1, d), torch.randn(B, T, 1, d)
    modes = F.one_hot(torch.full((B, T, H), 2), 3).float()
    modes[:, s] = F.one_hot(torch.zeros(H, dtype=torch.long), 3).float()

    def run(bit_index_of_s):
        bits = F.one_hot(torch.full((B, T), 3), 4).float()
        bits[:, s] = F.one_hot(torch.tensor(bit_index_of_s), 4).float()
        kw, vw = relaxed_kv_write(k, bits, (2, 4, 8, 16), 4), relaxed_kv_write(v, bits, (2, 4, 8, 16), 4)
        return reference_attention(q, kw, vw, modes, window=10), kw

    out16, _ = run(3)
    out2, kw2 = run(0)
    assert torch.all(out16[:, s] == 0) and torch.all(out2[:, s] == 0)  # skip reads nothing
    assert torch.equal(out16[:, :s], out2[:, :s])  # earlier tokens cannot see s
    assert not torch.allclose(out16[:, s + 1 :], out2[:, s + 1 :])  # later tokens read s ...
    assert torch.equal(kw2[:, s], fake_quantize(k[:, s], 2, 4))  # ... at 2 bits
