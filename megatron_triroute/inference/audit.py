"""Cost-audit counters: what the decisions ask for (audited) and what the kernels executed, per layer.

MACs are multiply-accumulates as in `routing.cost` (attention: d_h for q.k plus d_h for the
weighted V sum per key read and head; experts: 3 d d_e per real route). Projections (Q/K/V/O),
the controller and the LM head are counted separately from the budgeted attention-read and
expert MACs, so the budget fraction can be read either way (see docs/inference.md).

The audited counters are computed after a step from its decision tensors and the cache
(`count_attention`, every layer of a step at once, from `InferenceModel.finish`), never inside
the timed work. Beside them, `executed` holds per layer what the attention kernel itself counted
while it ran (`attn`: q.k and p.V MACs of every (head, key) it scored; `bytes_read`: the K/V
bytes of every slot it unpacked), so audited and executed can differ visibly (page granularity, a
slot scored for a head that then masks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..routing.modes import SKIP, read_start

COUNTERS = ("q_proj", "k_proj", "v_proj", "o_proj", "attn", "experts", "controller", "bytes_written", "bytes_read")
EXECUTED = ("attn", "bytes_read")
"""What the attention kernel counted as it ran (`CostAudit.executed`)."""


@dataclass
class CostAudit:
    n_layers: int
    layers: list[dict[str, int]] = field(default_factory=list)
    executed: list[dict[str, int]] = field(default_factory=list)
    """Per layer, the attention kernel's own counters (module doc)."""
    lm_head: int = 0
    tokens: int = 0
    """Tokens processed by the decoder (prompt and generated)."""
    dense_macs: float = 0.0
    """The dense reference (Appendix A) of the same tokens: sum over layers of 2 d (t+1) + 3 d d_f."""
    dense_kv_bytes: int = 0
    """The 16-bit cache the dense model would store for the same tokens."""
    requests: dict[int, list[float]] = field(default_factory=dict)
    """Per request id, over every token it processed: [budgeted MACs, dense MACs, KV bits written,
    dense KV bits] (`request_fractions`)."""

    def __post_init__(self):
        if not self.layers:
            self.layers = [dict.fromkeys(COUNTERS, 0) for _ in range(self.n_layers)]
        if not self.executed:
            self.executed = [dict.fromkeys(EXECUTED, 0) for _ in range(self.n_layers)]

    def add(self, layer: int, name: str, value) -> None:
        self.layers[layer][name] += int(value)

    def total(self, name: str) -> int:
        return sum(layer[name] for layer in self.layers)

    def total_executed(self, name: str) -> int:
        return sum(layer[name] for layer in self.executed)

    def take_executed(self, cache) -> None:
        """Add what the cache's kernels counted since `cache.executed` was last zeroed (the model
        zeroes it before a step it audits), then zero it."""
        for layer, values in enumerate(cache.executed.tolist()):
            for name, x in zip(EXECUTED, values):
                self.executed[layer][name] += x
        cache.executed.zero_()

    @property
    def budgeted_macs(self) -> int:
        """Attention reads + experts: what the budget's FLOPs fraction counts."""
        return self.total("attn") + self.total("experts")

    @property
    def projection_macs(self) -> int:
        return sum(self.total(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))

    def realised_flops(self) -> float:
        """Executed budgeted MACs over the dense model's on the same tokens."""
        return self.budgeted_macs / self.dense_macs if self.dense_macs else 0.0

    def realised_mem(self) -> float:
        """KV bytes written over the dense 16-bit cache's on the same tokens."""
        return self.total("bytes_written") / self.dense_kv_bytes if self.dense_kv_bytes else 0.0

    def add_requests(self, rids: list[int], costs: list[list[float]]) -> None:
        """Add one step's per-request costs (rows of [budgeted MACs, dense MACs, KV bits, dense KV bits])."""
        for rid, row in zip(rids, costs):
            total = self.requests.setdefault(rid, [0.0, 0.0, 0.0, 0.0])
            for i, x in enumerate(row):
                total[i] += x

    def request_totals(self, rid: int, since: list[float] | None = None,
                       until: list[float] | None = None) -> list[float]:
        """Request `rid`'s [budgeted MACs, dense MACs, KV bits, dense KV bits] over its tokens since
        the snapshot `since` (a copy of `requests[rid]`; None: all of them) up to the snapshot
        `until` (None: now)."""
        now = until if until is not None else self.requests.get(rid, [0.0] * 4)
        return [a - b for a, b in zip(now, since or [0.0] * 4)]

    def request_fractions(self, rid: int, since: list[float] | None = None,
                          until: list[float] | None = None) -> tuple[float, float]:
        """Request `rid`'s realised (FLOPs, memory) fractions as `realised_flops`/`realised_mem`
        define them, over its tokens between the snapshots `since` and `until` (request_totals)."""
        d = self.request_totals(rid, since, until)
        return (d[0] / d[1] if d[1] else 0.0, d[2] / d[3] if d[3] else 0.0)

    def summary(self) -> dict:
        return {name: self.total(name) for name in COUNTERS} | {
            "lm_head": self.lm_head, "tokens": self.tokens, "realised_flops": self.realised_flops(),
            "realised_mem": self.realised_mem(),
        } | {f"executed_{name}": self.total_executed(name) for name in EXECUTED}


def count_attention(audit: CostAudit, layers: list[int], cache, rows: torch.Tensor, mode: torch.Tensor,
                    option: torch.Tensor, t: torch.Tensor, valid: torch.Tensor | None, window: int,
                    d_model: int) -> None:
    """Add the audited attention counters of `layers` for N token rows, after the step that ran
    them, in one pass over all of them: rows (N,) cache rows, mode (layers, N, H) and option
    (layers, N) bit option, t (N,) positions, valid (N,) (None: every row). Reads the cache as the step left it
    (a step writes each layer's tokens before reading them). Host reads: the valid rows, the
    options, the counts' check (`newest_rows_read`) and, where it fails, two maxima, and one list
    of every layer's figures."""
    pools = cache.layers[layers[0]].pools
    n_kv, d = pools[0].n_kv, pools[0].d_head
    if valid is not None:
        keep = valid.nonzero().flatten()
        rows, t, mode, option = rows[keep], t[keep], mode[:, keep], option[:, keep]
    option = option.cpu()
    tokens = t.numel()
    slot_bytes = torch.stack([cache.slot_bytes(layer) for layer in layers])  # (layers, pools), host
    written = slot_bytes.gather(1, option).sum(1)
    pairs = (mode != SKIP).sum((1, 2)).cpu()
    read, keys = torch.zeros_like(written), torch.zeros_like(written)
    if tokens:
        lo = read_start(t.view(1, -1, 1), mode, window)  # (layers, N, H); skip: t + 1
        newest = newest_rows_read(cache, layers, rows, t, lo)
        if newest is not None:  # a decode step's rows: the cache's counts say it all
            slots, keys = newest
        else:
            requests, request = torch.unique(rows, return_inverse=True)
            slots, keys = slots_and_keys_read(
                [[pool.token_pos for pool in cache.layers[layer].pools] for layer in layers],
                torch.stack([cache.layer_tables[layer][:, requests] for layer in layers]), request, lo, t)
        read, keys = (slots.cpu() * slot_bytes).sum(1), keys.cpu()
    for layer, (q, w, r, k) in zip(layers, torch.stack([pairs, written, read, keys], 1).tolist()):
        audit.add(layer, "k_proj", tokens * n_kv * d * d_model)
        audit.add(layer, "v_proj", tokens * n_kv * d * d_model)
        audit.add(layer, "q_proj", q * d * d_model)
        audit.add(layer, "o_proj", q * d * d_model)
        audit.add(layer, "bytes_written", w)
        audit.add(layer, "bytes_read", r)
        audit.add(layer, "attn", 2 * d * k)


def newest_rows_read(cache, layers: list[int], rows: torch.Tensor, t: torch.Tensor,
                     lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`slots_and_keys_read`'s two figures from the cache's counts alone, where every row is its
    request's newest token: the request's filled slots over its pools (after the step) number
    exactly t + 1 at every layer, so its positions 0..t each hold one slot. Then row i's context in
    pool o is all of its request's slots there, and its (row, head) range [lo, t] meets t - lo + 1
    keys. Returns None otherwise (a prefill's earlier rows, a request seen twice): the caller takes
    `slots_and_keys_read`. One host read."""
    counts = cache.counts if layers == list(range(cache.counts.shape[0])) else \
        cache.counts[torch.as_tensor(layers, device=rows.device)]
    counts = counts.index_select(2, rows)  # (layers, pools, N)
    if not bool((counts.sum(1) == (t + 1).view(1, -1)).all()):
        return None
    return counts.sum(2), (t.view(1, -1, 1) - lo + 1).clamp(min=0).sum((1, 2))


def slots_and_keys_read(token_pos: list[list[torch.Tensor]], pages: torch.Tensor, request: torch.Tensor,
                        lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over Y layers' W pools at once, with `token_pos[y][o]` the slot positions of layer y's pool o
    and `pages` (Y, W, B, max pages; absent -1) each request's page list per pool, request (N,) each
    row's request, lo (Y, N, H) and hi (N,): per (layer, pool), the slots of row i's request at
    positions <= hi[i] (the row's context in that pool, whatever its heads read), summed over rows
    ((Y, W)); and per layer the keys the (row, head) ranges [lo, hi] meet in every pool, summed over
    rows, heads and pools ((Y,)); so a prefill of n tokens counts what n decode steps count. Memory
    O(Y x B x W x positions); two host reads."""
    Y, W, B, M = pages.shape
    tables = [tp for pools in token_pos for tp in pools]  # (pages, P) each, in (layer, pool) order
    P = tables[0].shape[1]
    first = torch.tensor([0] + [t.shape[0] for t in tables[:-1]], device=pages.device).cumsum(0).view(Y, W, 1, 1)
    slot = ((first + pages.clamp(min=0)) * P).unsqueeze(-1) + torch.arange(P, device=pages.device)  # (Y, W, B, M, P)
    pos = torch.cat([t.reshape(-1) for t in tables]).long()[slot]  # every pool's positions, one gather
    pos = torch.where((pages >= 0).unsqueeze(-1), pos, -1).permute(0, 2, 1, 3, 4).reshape(Y, B, W, M * P)
    L = M * P
    if L == 0:
        return torch.zeros(Y, W, dtype=torch.long, device=pos.device), torch.zeros(Y, dtype=torch.long, device=pos.device)
    size = max(int(hi.max()), int(pos.max())) + 2
    before = torch.zeros(Y, B, W, size, dtype=torch.long, device=pos.device)
    before.scatter_add_(3, pos + 1, (pos >= 0).long())  # a free slot (-1) adds 0 at index 0
    before = before.cumsum(3)  # before[y, b, o, p]: b's slots in layer y's pool o at positions < p
    y = torch.arange(Y, device=pos.device)
    upto = before[y.view(Y, 1), request.view(1, -1), :, (hi + 1).view(1, -1)]  # (Y, N, W)
    low = before[y.view(Y, 1, 1), request.view(1, -1, 1), :, lo.clamp(max=size - 1)]  # (Y, N, H, W); skip: lo = hi + 1
    return upto.sum(1), (upto.unsqueeze(2) - low).clamp(min=0).sum((1, 2, 3))
