"""Shared helpers of the export tests: the engine's own logits as the reference."""

import torch


def engine_model(checkpoint):
    from megatron_triroute.vocab import load_token_tables
    from megatron_triroute.inference.checkpoint import build_model, load_inference_checkpoint

    tree, state = load_inference_checkpoint(checkpoint)
    _, _, eod = load_token_tables(f"{tree['data']['path']}/tokenizer/token_tables.safetensors")
    return build_model(tree, state, eod), eod


def engine_logits(model, seq: list[int], decisions: dict | None = None) -> torch.Tensor:
    """(n, V) logits of one sequence alone, one prefill through the engine's paged cache; with
    `decisions`, the attention modes and bit options taken are added to its sets."""
    from megatron_triroute.inference.side_state import SideState

    cache = model.new_cache()
    cache.add_request(0)
    logits, outs = model.step(torch.tensor([seq]), torch.tensor([len(seq)]), [SideState()], cache, [0],
                              all_logits=True)
    if decisions is not None:
        for out in outs:
            decisions.setdefault("modes", set()).update(out.attn.y.argmax(-1).flatten().tolist())
            decisions.setdefault("bits", set()).update(out.bits.y.argmax(-1).flatten().tolist())
    return logits[0]


def left_pad(seqs: list[list[int]], pad: int):
    n = max(map(len, seqs))
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, n - len(s):] = torch.tensor(s)
        mask[b, n - len(s):] = 1
    return ids, mask


def sequences(vocab: int, eod: int) -> list[list[int]]:
    """Three prompts of different lengths; the longest has an EOD inside (document reset)."""
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 4, 14)]
    seqs[2][6] = eod
    return seqs
