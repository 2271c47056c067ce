"""`score_batch`: one padded prefill of sequences of different lengths gives, per sequence, the
log-probabilities and argmax matches of a token-by-token decode of that sequence alone, and its
cost audit is the sum of the sequences' own audits."""

import pytest
import torch

from megatron_triroute.evaluation.scoring import score_batch
from megatron_triroute.inference.audit import CostAudit
from megatron_triroute.inference.side_state import SideState
from tests.inference.test_engine import tiny_model

SEQUENCES = [[3, 9, 4, 7, 1, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [8, 8]]


def decode_alone(model, seq, audit):
    """Log-probabilities of seq[1:] from one token at a time through a fresh cache."""
    cache, state = model.new_cache(page_size=4), SideState()
    cache.add_request(0)
    rows = []
    for token in seq[:-1]:
        logits, _ = model.step(torch.tensor([[token]]), torch.tensor([1]), [state], cache, [0], audit)
        rows.append(logits[0])
    logits = torch.stack(rows).double()
    target = torch.tensor(seq[1:])
    return torch.log_softmax(logits, -1)[torch.arange(len(target)), target], logits.argmax(-1) == target


def test_batch_equals_token_by_token_alone():
    model = tiny_model()
    audit = CostAudit(model.config.model.n_layers)
    scored = score_batch(model, [s[:-1] for s in SEQUENCES], [s[1:] for s in SEQUENCES], audit, page_size=4)
    alone = CostAudit(model.config.model.n_layers)
    for seq, s in zip(SEQUENCES, scored):
        logprobs, greedy = decode_alone(model, seq, alone)
        assert s.logprobs.shape == (len(seq) - 1,)
        assert torch.allclose(s.logprobs, logprobs, atol=1e-5, rtol=0)
        assert torch.equal(s.greedy, greedy)
    assert audit.tokens == alone.tokens == sum(len(s) - 1 for s in SEQUENCES)
    assert audit.budgeted_macs == alone.budgeted_macs and audit.total("bytes_written") == alone.total("bytes_written")
    assert audit.realised_flops() == pytest.approx(alone.realised_flops(), rel=1e-12)
    assert 0 < audit.realised_flops() < 1 and 0 < audit.realised_mem() < 1


def test_refuses_mismatched_or_out_of_range_inputs():
    model = tiny_model()
    with pytest.raises(ValueError, match="2 inputs and 1 targets"):
        score_batch(model, [[1, 2]], [[3]])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        score_batch(model, [[1, 2]], [[3, 64]])
    assert score_batch(model, [], []) == []
