"""Cost-audit counters: what the engine executed and moved, per layer.

MACs are multiply-accumulates as in `routing.cost` (attention: d_h for q.k plus d_h for the
weighted V sum per key read and head; experts: 3 d d_e per real route). Projections (Q/K/V/O),
the controller and the LM head are counted separately from the budgeted attention-read and
expert MACs, so the budget fraction can be read either way (see docs/inference.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

COUNTERS = ("q_proj", "k_proj", "v_proj", "o_proj", "attn", "experts", "controller", "bytes_written", "bytes_read")


@dataclass
class CostAudit:
    n_layers: int
    layers: list[dict[str, int]] = field(default_factory=list)
    lm_head: int = 0
    tokens: int = 0
    """Tokens processed by the decoder (prompt and generated)."""
    dense_macs: float = 0.0
    """The dense reference (Appendix A) of the same tokens: sum over layers of 2 d (t+1) + 3 d d_f."""
    dense_kv_bytes: int = 0
    """The 16-bit cache the dense model would store for the same tokens."""

    def __post_init__(self):
        if not self.layers:
            self.layers = [dict.fromkeys(COUNTERS, 0) for _ in range(self.n_layers)]

    def add(self, layer: int, name: str, value) -> None:
        self.layers[layer][name] += int(value)

    def total(self, name: str) -> int:
        return sum(layer[name] for layer in self.layers)

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

    def summary(self) -> dict:
        return {name: self.total(name) for name in COUNTERS} | {
            "lm_head": self.lm_head, "tokens": self.tokens, "realised_flops": self.realised_flops(),
            "realised_mem": self.realised_mem(),
        }
