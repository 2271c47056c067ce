"""Cost-audit counters: what the decisions ask for (audited) and what the kernels executed, per layer.

MACs are multiply-accumulates as in `routing.cost` (attention: d_h for q.k plus d_h for the
weighted V sum per key read and head; experts: 3 d d_e per real route). Projections (Q/K/V/O),
the controller and the LM head are counted separately from the budgeted attention-read and
expert MACs, so the budget fraction can be read either way (see docs/inference.md).

The audited counters are computed after a step from its decision tensors and the cache
(`count_attention`, the model's `audit_step`), never inside the timed work. Beside them,
`executed` holds per layer what the attention kernel itself counted while it ran (`attn`: q.k and
p.V MACs of every (head, key) it scored; `bytes_read`: the K/V bytes of every slot it unpacked),
so audited and executed can differ visibly (page granularity, a slot scored for a head that
then masks it).
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


def count_attention(audit: CostAudit, layer: int, cache, rows: torch.Tensor, mode: torch.Tensor, option: torch.Tensor,
                    t: torch.Tensor, valid: torch.Tensor, window: int, d_model: int) -> None:
    """Add one layer's audited attention counters for N token rows, after the step that ran them:
    rows (N,) cache rows, mode (N, H), option (N,) bit option, t (N,) positions, valid (N,). Reads
    the cache as the step left it (a step writes each layer's tokens before reading them)."""
    H = mode.shape[1]
    pools = cache.layers[layer].pools
    n_kv, d = pools[0].n_kv, pools[0].d_head
    keep = valid.nonzero().flatten()
    rows, mode, option, t = rows[keep], mode[keep], option[keep], t[keep]
    reading = mode != SKIP
    tokens, pairs = keep.numel(), int(reading.sum())
    audit.add(layer, "k_proj", tokens * n_kv * d * d_model)
    audit.add(layer, "v_proj", tokens * n_kv * d * d_model)
    audit.add(layer, "q_proj", pairs * d * d_model)
    audit.add(layer, "o_proj", pairs * d * d_model)
    slot_bytes = cache.slot_bytes(layer)
    audit.add(layer, "bytes_written", int(slot_bytes[option.cpu()].sum()))
    if tokens == 0:
        return
    lo = read_start(t.view(-1, 1), mode, window)  # skip: t + 1
    requests, request = torch.unique(rows, return_inverse=True)
    slots, keys = slots_and_keys_read([pool.token_pos for pool in pools], cache.layer_tables[layer][:, requests],
                                      request, lo, t)
    audit.add(layer, "bytes_read", int((slots.cpu() * slot_bytes).sum()))
    audit.add(layer, "attn", 2 * d * keys)


def slots_and_keys_read(token_pos: list[torch.Tensor], pages: torch.Tensor, request: torch.Tensor, lo: torch.Tensor,
                        hi: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Over a layer's W pools at once, with `token_pos[o]` pool o's slot positions and `pages` (W, B,
    max pages; absent -1) each request's page list per pool, request (N,) each row's request:
    per pool, the slots of row i's request at positions <= hi[i] (the row's context in that pool,
    whatever its heads read), summed over rows ((W,) tensor); and the keys the (row, head) ranges
    [lo, hi] meet in every pool, summed over rows, heads and pools; so a prefill of n tokens counts
    what n decode steps count. Memory O(B x W x positions); three host reads."""
    pos = torch.stack([torch.where(pages[o].unsqueeze(-1) >= 0, tp[pages[o].clamp(min=0)], -1).flatten(1)
                       for o, tp in enumerate(token_pos)], 1).long()  # (B, W, L)
    if pos.shape[2] == 0:
        return torch.zeros(pos.shape[1], dtype=torch.long, device=pos.device), 0
    size = max(int(hi.max()), int(pos.max())) + 2
    before = torch.zeros(*pos.shape[:2], size, dtype=torch.long, device=pos.device)
    before.scatter_add_(2, pos + 1, (pos >= 0).long())  # a free slot (-1) adds 0 at index 0
    before = before.cumsum(2)  # before[b, o, p]: b's slots in pool o at positions < p
    upto = before[request, :, hi + 1]  # (N, W)
    keys = upto.unsqueeze(1) - before[request.unsqueeze(1), :, lo.clamp(max=size - 1)]  # (N, H, W); skip: lo = hi + 1
    return upto.sum(0), int(keys.clamp(min=0).sum())
