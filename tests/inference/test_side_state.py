"""Incremental side features equal `static_side_features` over the whole sequence, whatever the
chunking, including an EOD mid-prompt (the document position restarts after it) and requests of
different lengths in one padded batch."""

import torch

from megatron_triroute.inference.side_state import SideState, advance
from megatron_triroute.routing.side_features import TokenTables, document_positions, static_side_features


def test_chunked_features_equal_full_sequence_features():
    g = torch.Generator().manual_seed(0)
    V, eod = 20, 3
    tables = TokenTables(torch.log_softmax(torch.randn(V, generator=g), 0), torch.rand(V, generator=g) < 0.5, eod)
    seq = torch.randint(4, V, (2, 14), generator=g)
    seq[0, 5] = eod
    seq[1, 9] = eod
    want = static_side_features(seq, tables, 64)
    assert document_positions(seq, eod)[0, 6] == 0  # the boundary is really there
    for chunks in ([14], [6, 1, 7], [1] * 14, [5, 9]):
        states = [SideState(), SideState()]
        got, t0 = [], 0
        for n in chunks:
            got.append(advance(seq[:, t0 : t0 + n], torch.tensor([n, n]), states, tables, 64))
            t0 += n
        assert torch.equal(torch.cat(got, 1), want), chunks
    # Different lengths in one padded batch: request 1 consumes only 4 of the 6 columns.
    states = [SideState(), SideState()]
    part = advance(seq[:, :6], torch.tensor([6, 4]), states, tables, 64)
    assert states[1].length == 4 and states[0].length == 6
    assert torch.equal(part[1, :4], want[1, :4])
    rest = advance(seq[1:, 4:], torch.tensor([10]), states[1:], tables, 64)
    assert torch.equal(rest[0], want[1, 4:])


def test_a_decode_step_equals_the_chunk_path_bit_for_bit():
    """`advance`'s one-token path (host integers) against its chunk path (tensor ops) on the same
    one-token steps: features bit for bit and the same states, with EODs (also as the state's last
    token), tokens that do or do not start a word, and requests that consume nothing in a step."""
    from megatron_triroute.inference.side_state import _advance_chunk, _advance_one

    g = torch.Generator().manual_seed(1)
    V, eod, B = 12, 2, 5
    tables = TokenTables(torch.log_softmax(torch.randn(V, generator=g), 0), torch.rand(V, generator=g) < 0.4, eod)
    one, chunk = [SideState() for _ in range(B)], [SideState() for _ in range(B)]
    for step in range(40):
        tokens = torch.randint(0, V, (B, 1), generator=g)
        tokens[torch.rand(B, generator=g) < 0.15] = eod
        lengths = (torch.rand(B, generator=g) < 0.8).long()
        got = _advance_one(tokens, lengths, one, tables, 64)
        want = _advance_chunk(tokens, lengths, chunk, tables, 64)
        assert got.dtype == want.dtype and torch.equal(got, want), step
        assert one == chunk, step
    assert any(s.doc_start > 0 for s in one) and any(s.word_start > s.doc_start for s in one)
