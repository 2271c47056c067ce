"""Decode throughput and KV memory: Dense vs the routed systems, same backbone, same prompts.

    python benchmarks/bench_decode.py [--checkpoint runs/tiny/checkpoints] [--data DIR] [--shape 160m]
        [--contexts 512 2048 8192] [--batches 1 8] [--steps 2] [--repeats 3] [--threads 1] [--json] [--quick]

Systems (float32 compute, one fixed thread count, decode only):
- **Dense**: the best plain PyTorch decoder, not our engine forced dense: per layer a contiguous
  float16 KV cache [B, H_kv, T_max, d_h] and `scaled_dot_product_attention` (GQA) over it, a dense
  SwiGLU FFN of width d_ff.
- **KV-quant-only, MoD, Independent combo, TriRoute**: `megatron_triroute.inference` (`InferenceModel`
  with its paged cache) on `systems.system_config(name, backbone)`.

Two backbones:
- the trained main-job checkpoint (`--checkpoint`): its TriRoute model runs with its own trained,
  priced controller; the other systems have no trained weights there and run random weights with
  the synthetic controller below;
- a 160m-shaped model (`--shape`), SYNTHETIC: random weights, and every controller replaced by
  `MixController`, which takes hard decisions with fixed probabilities (the realised decision mix
  of the checkpoint's controller on a real prompt, or `DEFAULT_MIX` without a checkpoint) from a
  hash of the hidden state. MoD and the Independent combo process the fraction `router.mod_capacity`
  of tokens. Its figures say what the engine does with such a mix, not what a trained model chooses.

The prompt's K/V are written straight into each cache (random values at widths drawn from the
mix, float16 for Dense) instead of running a prefill, and each request's routing state is set as a
one-document prefill would leave it; only decode steps (one token per request) are timed: after one
warm-up step, `--repeats` runs of `--steps` steps, median tokens/s. The engine's cost audit counts the
timed steps themselves (its counters run inside them, as they do when serving), so: `macs_per_token` is every executed multiply-accumulate (Q/K/V/O
projections, attention reads, experts, controller, LM head) per decoded token; Dense's are counted
from what its decoder executes, in the same units. `limit` = Dense MACs / system MACs (the speed-up a
perfect implementation would reach), `efficiency` = speed-up / limit, `kv_bytes_ratio` = cache bytes
per prompt token measured from the storage (filled slots) over Dense's float16 bytes,
`cost_audit_rel_err` = max over layers of |audited attention + expert MACs - routing.cost.hard_cost
of the same decisions| / hard_cost, `ffn_weight_read_ratio` = FFN weight bytes one decode step reads
over a dense FFN's (each distinct expert of the step read once: tokens are grouped by expert).

`--json` prints one object; its top-level `speedup_vs_dense`, `limit`, `efficiency` (batch 1), the
same with `_b8` (batch 8), `kv_bytes_ratio` and `cost_audit_max_rel_err` are the synthetic shape's
TriRoute at 2,048 context (or the largest context below it). `--quick` runs tiny shapes in seconds.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from megatron_triroute.config import ModelConfig, TriRouteConfig  # noqa: E402
from megatron_triroute.routing.modes import FULL, N_MODES, SKIP  # noqa: E402
from megatron_triroute.routing.controller import AxisDecision, RouterOutput  # noqa: E402
from megatron_triroute.routing.cost import expert_width, hard_cost  # noqa: E402
from megatron_triroute.routing.gating import NULL_EXPERT, ExpertRoutes  # noqa: E402
from megatron_triroute.systems import system_config  # noqa: E402

ROUTED = ("kvquant", "mod", "independent", "triroute")
DEFAULT_MIX = {"attn": [0.3, 0.3, 0.4], "bits": [0.25, 0.25, 0.25, 0.25], "expert_null": 0.3}
"""Synthetic mix without a checkpoint: attention (skip, local, full) per (token, head), bit options
over router.bits, and the probability that a token's first route is the null expert."""
TARGETS = {"efficiency": 0.85, "kv_bytes_ratio": (0.40, 0.02), "cost_audit_max_rel_err": 0.01}
"""The issue's compass at a (0.55, 0.40) budget; printed beside the measurements, never asserted."""
MAC_COUNTERS = ("q_proj", "k_proj", "v_proj", "o_proj", "attn", "experts", "controller")


# --- Dense baseline -----------------------------------------------------------------------------
def rope_bhtd(x: torch.Tensor, t: int) -> torch.Tensor:
    """x (B, H, 1, d) at position t: Megatron's non-interleaved rotary embedding."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat([inv * t, inv * t])
    x1, x2 = x.chunk(2, -1)
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


class DenseDecoder(nn.Module):
    """Plain decoder: contiguous float16 K/V cache, SDPA, dense SwiGLU. Random weights (timing only)."""

    def __init__(self, m: ModelConfig, batch: int, max_len: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def w(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) * 0.02, requires_grad=False)

        self.m = m
        D, H, Hk, d, L = m.d_model, m.n_heads, m.n_kv_heads, m.d_head, m.n_layers
        self.emb = w(m.vocab_size, D)
        self.wq = nn.ParameterList(w(H * d, D) for _ in range(L))
        self.wkv = nn.ParameterList(w(2 * Hk * d, D) for _ in range(L))
        self.wo = nn.ParameterList(w(D, H * d) for _ in range(L))
        self.fc1 = nn.ParameterList(w(2 * m.d_ff, D) for _ in range(L))
        self.fc2 = nn.ParameterList(w(D, m.d_ff) for _ in range(L))
        self.head = w(m.vocab_size, D)
        self.k = torch.zeros(L, batch, Hk, max_len, d, dtype=torch.float16)
        self.v = torch.zeros_like(self.k)
        self.t = 0

    def fill(self, length: int, seed: int = 1) -> None:
        """Write `length` prompt tokens of random K/V (the synthetic prefill)."""
        g = torch.Generator().manual_seed(seed)
        shape = self.k[:, :, :, :length].shape
        self.k[:, :, :, :length] = torch.randn(shape, generator=g).half()
        self.v[:, :, :, :length] = torch.randn(shape, generator=g).half()
        self.t = length

    def macs_per_token(self, t: int) -> int:
        """MACs one token at position t executes, in the audit's units (one per weight; 2 d_h per (head, key))."""
        m = self.m
        proj = (2 * m.n_heads + 2 * m.n_kv_heads) * m.d_head * m.d_model
        layer = proj + 2 * m.d_head * m.n_heads * (t + 1) + 3 * m.d_model * m.d_ff
        return m.n_layers * layer + m.d_model * m.vocab_size

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of one new token per request."""
        m, t = self.m, self.t
        B = tokens.shape[0]
        x = self.emb[tokens]  # (B, D)
        for i in range(m.n_layers):
            h = F.rms_norm(x, (m.d_model,), eps=1e-5)
            q = rope_bhtd((h @ self.wq[i].T).view(B, m.n_heads, 1, m.d_head), t)
            k, v = (h @ self.wkv[i].T).view(B, 2, m.n_kv_heads, 1, m.d_head).unbind(1)
            self.k[i, :, :, t : t + 1] = rope_bhtd(k, t).half()
            self.v[i, :, :, t : t + 1] = v.half()
            kk, vv = self.k[i, :, :, : t + 1].float(), self.v[i, :, :, : t + 1].float()
            o = F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)  # (B, H, 1, d)
            x = x + o.reshape(B, -1) @ self.wo[i].T
            h = F.rms_norm(x, (m.d_model,), eps=1e-5)
            gate, up = (h @ self.fc1[i].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ self.fc2[i].T
        self.t = t + 1
        return F.rms_norm(x, (m.d_model,), eps=1e-5) @ self.head.T


# --- synthetic decision mix ---------------------------------------------------------------------
class MixController(nn.Module):
    """Hard decisions drawn with fixed probabilities from a hash of the hidden state (deterministic
    per token); returns the RouterOutput the engine reads, for any of the routed systems."""

    def __init__(self, config: TriRouteConfig, layer: int, mix: dict):
        super().__init__()
        self.config, self.mix = config, mix
        g = torch.Generator().manual_seed(1000 + layer)
        self.register_buffer("proj", torch.randn(config.model.d_model, config.model.n_heads + 4, generator=g))

    @staticmethod
    def _pick(u: torch.Tensor, probs) -> torch.Tensor:
        edges = torch.tensor(probs, dtype=torch.float32).cumsum(0)
        return torch.bucketize(u.contiguous(), edges[:-1], right=True)

    def forward(self, hidden, side, noise_key=None, tau=1.0, prev=None) -> RouterOutput:
        r, m = self.config.router, self.config.model
        B, T = hidden.shape[:2]
        H = m.n_heads
        u = torch.frac(torch.sin((hidden.float() @ self.proj) * 12.9898) * 43758.5453).abs()  # (B, T, H+4) in [0, 1)
        block = r.kind in ("mod", "independent")
        processed = u[..., H] < r.mod_capacity if block else torch.ones(B, T, dtype=torch.bool)
        if block:
            attn = torch.where(processed, FULL, SKIP).unsqueeze(-1).expand(B, T, H)
        elif r.attn_routing:
            attn = self._pick(u[..., :H], self.mix["attn"])
        else:
            attn = torch.full((B, T, H), FULL)
        n_bits = len(r.bits) if r.bit_routing else 1
        bits = self._pick(u[..., H + 1], self.mix["bits"]) if r.bit_routing else torch.zeros(B, T, dtype=torch.long)
        experts = None
        if r.expert_routing:
            k, E = r.top_k, r.num_experts
            first = (u[..., H + 2] * E).long().clamp_max(E - 1)
            index = torch.stack([(first + j) % E for j in range(k)], -1)  # k distinct experts
            if r.null_expert and r.kind == "triroute":
                index[..., 0] = torch.where(u[..., H + 3] < self.mix["expert_null"], NULL_EXPERT, index[..., 0])
            if block:
                index = torch.where(processed.unsqueeze(-1), index, NULL_EXPERT)
            experts = ExpertRoutes(probs=torch.zeros(B, T, E + int(r.null_expert)), index=index,
                                   weight=torch.full(index.shape, 1.0 / k), option=index.clamp_min(0))
        ya, yb = F.one_hot(attn, N_MODES).float(), F.one_hot(bits, n_bits).float()
        return RouterOutput(attn=AxisDecision(ya, ya, attn), bits=AxisDecision(yb, yb, bits), experts=experts)


def measure_mix(decisions: list[list[RouterOutput]], n_bits: int) -> dict:
    """The realised decision mix of executed decisions (all layers and steps pooled)."""
    outs = [o for step in decisions for o in step]
    modes = torch.cat([o.attn.y.argmax(-1).flatten() for o in outs])
    bits = torch.cat([o.bits.y.argmax(-1).flatten() for o in outs])
    firsts = [o.experts.index[..., 0].flatten() for o in outs if o.experts is not None]
    return {"attn": [float((modes == i).float().mean()) for i in range(N_MODES)],
            "bits": [float((bits == i).float().mean()) for i in range(n_bits)],
            "expert_null": float((torch.cat(firsts) < 0).float().mean()) if firsts else 0.0}


# --- routed systems through the engine ----------------------------------------------------------
def build_routed(config: TriRouteConfig, mix: dict, seed: int = 0):
    """Random-weight `InferenceModel` whose controllers are `MixController(mix)` (the audit still counts
    the MACs of the controller the system deploys)."""
    from megatron_triroute.inference.model import InferenceModel

    model = InferenceModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() >= 2 else torch.ones(p.shape))
    for i, layer in enumerate(model.layers):
        layer.controller = MixController(config, i, mix)
    return model.eval()


def fill_cache(model, context: int, batch: int, bit_probs, seed: int):
    """A cache holding `batch` requests of `context` random prompt tokens, K/V random at widths drawn
    from `bit_probs` (written by the engine's own cache write), and each request's routing state."""
    from megatron_triroute.inference.side_state import SideState

    cfg = model.config
    m, r = cfg.model, cfg.router
    P = 16
    cache = model.new_cache(page_size=P, initial_pages=batch * (context // P + 8))
    rids = list(range(batch))
    for rid in rids:
        cache.add_request(rid)
    g = torch.Generator().manual_seed(seed)
    n_options = len(r.bits) if r.bit_routing else 1
    probs = torch.tensor(bit_probs if n_options > 1 else [1.0])
    row = torch.arange(batch).repeat_interleave(context)
    positions = torch.arange(context).repeat(batch)
    for layer in range(m.n_layers):
        option = torch.multinomial(probs, row.numel(), replacement=True, generator=g)
        k = torch.randn(row.numel(), m.n_kv_heads, m.d_head, generator=g)
        v = torch.randn(row.numel(), m.n_kv_heads, m.d_head, generator=g)
        cache.write(layer, rids, row, option, positions, k, v)
    last = torch.randint(0, m.vocab_size, (batch,), generator=g)
    states = [SideState(length=context, last_token=int(t), doc_start=0, word_start=context - 1) for t in last]
    return cache, rids, states, last


def time_decode(step, tokens: torch.Tensor, steps: int, repeats: int) -> list[float]:
    """tokens/s of `repeats` runs of `steps` decode steps (the caller has run a warm-up step)."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            tokens = step(tokens)
        rates.append(steps * tokens.shape[0] / (time.perf_counter() - start))
    return rates


def audit_macs(audit) -> int:
    """Every multiply-accumulate the engine executed (projections, reads, experts, controller, LM head)."""
    return sum(audit.total(n) for n in MAC_COUNTERS) + audit.lm_head


def cost_audit_error(audit, steps: list[tuple[torch.Tensor, list[RouterOutput]]], config: TriRouteConfig) -> float:
    """Max over layers of |audited attention + expert MACs - hard_cost of the same decisions| / hard_cost."""
    m, r = config.model, config.router
    worst = 0.0
    for layer in range(m.n_layers):
        model_macs = 0.0
        for positions, outs in steps:
            o = outs[layer]
            index = None if o.experts is None else o.experts.index
            hc = hard_cost(o.attn.y.argmax(-1), index, o.bits.y.argmax(-1), positions, m, r)
            model_macs += float(hc.flops.sum())
        counted = audit.layers[layer]["attn"] + audit.layers[layer]["experts"]
        worst = max(worst, abs(counted - model_macs) / max(model_macs, 1.0))
    return worst


def ffn_weight_read_ratio(steps: list[tuple[torch.Tensor, list[RouterOutput]]], config: TriRouteConfig) -> float:
    """Mean over decode steps of the FFN weight bytes read over a dense FFN's: each distinct expert
    run in the step is read once, sum_l |experts run| d_e / (L d_ff)."""
    m, r = config.model, config.router
    ratios = []
    for _, outs in steps:
        width = 0
        for o in outs:
            if o.experts is None:
                width += m.d_ff
            else:
                width += int(torch.unique(o.experts.index[o.experts.index >= 0]).numel()) * expert_width(m, r)
        ratios.append(width / (len(outs) * m.d_ff))
    return statistics.mean(ratios)


def run_routed(model, batch: int, context: int, steps: int, repeats: int, bit_probs) -> dict:
    """Time decode of `model` on a synthetically filled cache; the audit counts the timed steps."""
    from megatron_triroute.inference.audit import CostAudit

    cache, rids, states, last = fill_cache(model, context, batch, bit_probs, seed=7)
    kv = cache.memory()["used"] / (batch * context)
    ones = torch.ones(batch, dtype=torch.long)
    record: list = []

    audit = None

    def step(tokens):
        positions = torch.tensor([s.length for s in states]).view(batch, 1)
        logits, outs = model.step(tokens.view(batch, 1), ones, states, cache, rids, audit)
        if audit is not None:
            record.append((positions, outs))
        return logits.argmax(-1)

    tokens = step(last)  # warm-up, not counted
    audit = CostAudit(model.config.model.n_layers)
    rates = time_decode(step, tokens, steps, repeats)
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
            "macs_per_token": audit_macs(audit) / audit.tokens, "kv_bytes_per_token": kv,
            "cost_audit_rel_err": cost_audit_error(audit, record, model.config),
            "ffn_weight_read_ratio": ffn_weight_read_ratio(record, model.config),
            "decode_mix": measure_mix([outs for _, outs in record], len(model.config.router.bits))}


def run_dense(m: ModelConfig, batch: int, context: int, steps: int, repeats: int) -> dict:
    dec = DenseDecoder(m, batch, context + steps * repeats + 2)
    dec.fill(context)
    tokens = dec.step(torch.zeros(batch, dtype=torch.long)).argmax(-1)  # warm-up
    start = dec.t  # position of the first timed step
    rates = time_decode(lambda tok: dec.step(tok).argmax(-1), tokens, steps, repeats)
    macs = statistics.mean(dec.macs_per_token(start + i) for i in range(steps * repeats))
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates, "macs_per_token": macs,
            "kv_bytes_per_token": 2 * m.n_layers * m.n_kv_heads * m.d_head * 2}


# --- driver -------------------------------------------------------------------------------------
def bench(label: str, base: TriRouteConfig, mix: dict, contexts, batches, steps, repeats, trained=None, log=print):
    """Rows `ctx{C}_b{B}` -> {system: figures} for every context and batch size."""
    models = {name: build_routed(system_config(name, base), mix) for name in ROUTED}
    if trained is not None:
        models["triroute"] = trained
    rows = {}
    for context in contexts:
        for batch in batches:
            key = f"ctx{context}_b{batch}"
            dense = run_dense(base.model, batch, context, steps, repeats)
            rows[key] = {"dense": dense}
            log(f"[{label}] {key} {'dense':12s} {dense['tokens_per_s']:9.2f} tok/s")
            for name, model in models.items():
                r = run_routed(model, batch, context, steps, repeats, mix["bits"])
                r["speedup_vs_dense"] = r["tokens_per_s"] / dense["tokens_per_s"]
                r["limit"] = dense["macs_per_token"] / r["macs_per_token"]
                r["efficiency"] = r["speedup_vs_dense"] / r["limit"]
                r["kv_bytes_ratio"] = r["kv_bytes_per_token"] / dense["kv_bytes_per_token"]
                rows[key][name] = r
                log(f"[{label}] {key} {name:12s} {r['tokens_per_s']:9.2f} tok/s  speedup {r['speedup_vs_dense']:.2f}  "
                    f"limit {r['limit']:.2f}  efficiency {r['efficiency']:.2f}  kv {r['kv_bytes_ratio']:.3f}  "
                    f"audit err {r['cost_audit_rel_err']:.1e}  ffn weights read {r['ffn_weight_read_ratio']:.2f}")
    return rows


def load_checkpoint_model(checkpoint: str, data: str | None):
    """The trained `InferenceModel` of a run's checkpoint, and its tokenizer."""
    from megatron_triroute.evaluation.loading import load_for_evaluation

    loaded = load_for_evaluation(checkpoint, data)
    return loaded.model, loaded.processor


def checkpoint_mix(model, processor, length: int) -> dict:
    """Realised decision mix of the trained controller on real code (json.decoder's source, the
    kind of text the main job trained on), one prefill of `length` tokens."""
    import json.decoder

    from megatron_triroute.inference.side_state import SideState

    ids = processor.encode(inspect.getsource(json.decoder))[:length]
    cache = model.new_cache()
    cache.add_request(0)
    _, outs = model.step(torch.tensor([ids]), torch.tensor([len(ids)]), [SideState()], cache, [0])
    return measure_mix([outs], len(model.config.router.bits))


def headline(rows: dict, contexts, batches) -> dict:
    """The JSON's top-level figures: TriRoute at 2,048 context (or the largest context below it)."""
    ctx = max([c for c in contexts if c <= 2048] or [min(contexts)])
    out = {"headline_context": ctx}
    for b, suffix in ((min(batches), ""), (max(batches), "_b8")):
        r = rows[f"ctx{ctx}_b{b}"]["triroute"]
        for k in ("speedup_vs_dense", "limit", "efficiency", "ffn_weight_read_ratio"):
            out[k + suffix] = r[k]
    out["kv_bytes_ratio"] = rows[f"ctx{ctx}_b{min(batches)}"]["triroute"]["kv_bytes_ratio"]
    out["cost_audit_max_rel_err"] = max(r["cost_audit_rel_err"] for row in rows.values()
                                        for name, r in row.items() if name != "dense")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None, help="a trained run's checkpoint root (its TriRoute model and shape)")
    p.add_argument("--data", default=None, help="the run's data directory (default: its recorded data.path)")
    p.add_argument("--shape", default="160m", help="recipe whose backbone is benchmarked SYNTHETICALLY ('' = none)")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=2, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true", help="tiny shapes and contexts: seconds, for tests")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    a = p.parse_args(argv)
    if a.quick:
        a.shape, a.contexts, a.batches, a.steps, a.repeats = "tiny", [32, 96], [1, 8], 2, 1
    return a


def main(argv=None) -> dict:
    with torch.no_grad():  # scoped: an in-process caller keeps its autograd state
        return _main(argv)


def _main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.json else (lambda s: print(s, flush=True))
    result = {"threads": a.threads, "machine": platform.machine(), "torch": torch.__version__,
              "contexts": a.contexts, "batches": a.batches, "steps": a.steps, "repeats": a.repeats, "targets": TARGETS}
    mix = dict(DEFAULT_MIX)
    if a.checkpoint:
        model, processor = load_checkpoint_model(a.checkpoint, a.data)
        mix = checkpoint_mix(model, processor, 512)
        result["checkpoint_mix"] = mix
        log(f"checkpoint decision mix (prefill of real code): {json.dumps(mix)}")
        result["checkpoint"] = bench("checkpoint", model.config, mix, a.contexts, a.batches, a.steps, a.repeats,
                                     model, log)
    if a.shape:
        from megatron_triroute.training.recipes import get_recipe

        base = get_recipe(a.shape).triroute.validate()
        result["synthetic_shape"] = a.shape
        result["synthetic_mix"] = mix
        log(f"{a.shape} shape is SYNTHETIC: random weights, controllers replaced by a fixed decision mix")
        rows = bench(f"{a.shape} SYNTHETIC", base, mix, a.contexts, a.batches, a.steps, a.repeats, None, log)
        result["synthetic"] = rows
        result |= headline(rows, a.contexts, a.batches)
        log(f"headline ({a.shape} SYNTHETIC, TriRoute, context {result['headline_context']}): "
            f"speedup {result['speedup_vs_dense']:.2f} / limit {result['limit']:.2f} = efficiency "
            f"{result['efficiency']:.2f} (target >= {TARGETS['efficiency']}); batch 8: efficiency "
            f"{result['efficiency_b8']:.2f}, FFN weights read {result['ffn_weight_read_ratio_b8']:.2f}x dense; "
            f"kv bytes {result['kv_bytes_ratio']:.3f} (target {TARGETS['kv_bytes_ratio'][0]} +- "
            f"{TARGETS['kv_bytes_ratio'][1]} at a (0.55, 0.40) budget); cost audit max rel err "
            f"{result['cost_audit_max_rel_err']:.1e} (target <= {TARGETS['cost_audit_max_rel_err']})")
    if a.json:
        print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
