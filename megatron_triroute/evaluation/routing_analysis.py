"""What the controller does on held-out tokens: decisions and their cost per token and layer,
token categories, depth bands, k-means clusters of routing vectors, cross-axis mutual information.

Decisions are the engine's (noise-free, priced: what runs at inference) on the trainer's held-out
micro-batches (`perplexity.evaluation_sets`). Per token and layer the cost is
`routing.cost.hard_cost` of those decisions, over `dense_cost` of the same token:
attention = attention-read MACs over the dense token's (2 d (t+1)); flops = attention-read +
expert MACs over the dense token's (the budget's FLOPs fraction); mem = K/V bits stored
(metadata included) over 16-bit K/V; experts = real experts run.

Token categories (ours; first match wins, from the sentencepiece piece and the token tables):
sentence-initial (first token of a document, or after a piece ending in . ! ? or a newline),
number (a digit in the piece), code symbol (no letter or digit: punctuation, operators, brackets,
so prose punctuation counts here too), function word (a closed list of English function words),
rare/entity (unigram log-probability in the rarest 10 % of the analysed tokens, or a capitalised
word start), content word (everything else). A byte-fallback piece counts as its ASCII character
(so a newline is a code symbol); a byte of a non-ASCII character counts as rare/entity.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from ..routing.modes import N_MODES

CATEGORIES = ("sentence-initial", "function word", "content word", "rare/entity", "number", "code symbol")
FUNCTION_WORDS = frozenset("""a an the and or but nor so yet if then else of in on at to for from by with without
about as into onto over under between through during before after above below up down out off is are was were
be been being am do does did have has had having it its this that these those he she they we you i me him her them
us my your his their our not no can could will would shall should may might must which who whom whose what when
where why how than too very all any each some such only own same there here""".split())
RESOURCES = ("attention", "experts", "mem", "flops")
RESOURCE_LABELS = {"attention": "attention reads / dense", "experts": "real experts run",
                   "mem": "KV bits / 16-bit", "flops": "FLOPs / dense (budgeted)"}


@dataclass
class Routing:
    tokens: np.ndarray      # (N,) token ids
    positions: np.ndarray   # (N,)
    categories: np.ndarray  # (N,) index into CATEGORIES
    attn: np.ndarray        # (N, L, H) mode per head: 0 skip, 1 local, 2 full
    experts: np.ndarray | None  # (N, L, k) expert ids, -1 = null; None without expert routing
    bits: np.ndarray        # (N, L) option index into router.bits
    cost: dict[str, np.ndarray]  # RESOURCES -> (N, L)

    @property
    def n_layers(self) -> int:
        return self.attn.shape[1]


def collect(model, batches, pieces: list[str], page_size: int = 16, progress=None) -> Routing:
    """Run the held-out `batches` (MicroBatch list) through the engine and keep every decision;
    `pieces` are the tokenizer's piece strings (for the categories)."""
    from ..routing.cost import dense_cost, hard_cost
    from .scoring import score_batch

    m, r = model.config.model, model.config.router
    per_token = ("tokens", "positions", "prev")
    per_layer_keys = ("attn", "experts", "bits", "attention", "runs", "mem", "flops")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in per_token + per_layer_keys}
    for i, mb in enumerate(batches):
        decisions: list = []
        score_batch(model, [row.tolist() for row in mb.tokens], [row.tolist() for row in mb.labels], None,
                    page_size, decisions)
        B, n = mb.tokens.shape
        positions = torch.arange(n).view(1, n).expand(B, n)
        dense = dense_cost(positions, m)
        attn_dense = 2.0 * m.d_model * (positions.double() + 1.0)
        layer: dict[str, list[torch.Tensor]] = {k: [] for k in per_layer_keys}
        for out in decisions[0]:
            mode, bits = out.attn.y.argmax(-1), out.bits.y.argmax(-1)  # what the engine executes
            index = None if out.experts is None else out.experts.index
            hard = hard_cost(mode, index, bits, positions, m, r)
            layer["attn"].append(mode)
            layer["bits"].append(bits)
            if index is not None:
                layer["experts"].append(index)
            layer["attention"].append(hard.attn_key_macs / attn_dense)
            layer["runs"].append(hard.experts_run)
            layer["mem"].append(hard.kv_bits / dense.mem)
            layer["flops"].append((hard.attn_key_macs + hard.expert_macs) / dense.flops)
        flat = lambda t: t.reshape(B * n, *t.shape[2:]).numpy()
        parts["tokens"].append(flat(mb.tokens))
        parts["positions"].append(flat(positions))
        parts["prev"].append(flat(torch.cat([torch.full((B, 1), -1), mb.tokens[:, :-1]], 1)))
        for k in per_layer_keys:
            if layer[k]:
                parts[k].append(flat(torch.stack(layer[k], 2)))
        if progress is not None:
            progress.update(B * n, f"routing {i + 1}/{len(batches)}", force=i + 1 == len(batches))
    cat = lambda k: np.concatenate(parts[k]) if parts.get(k) else None
    tokens = cat("tokens")
    cost = {"attention": cat("attention"), "experts": cat("runs").astype(np.float64), "mem": cat("mem"),
            "flops": cat("flops")}
    categories = categorize(tokens, cat("prev"), model.tables.log_prob.numpy(), model.tables.eod_id, pieces)
    return Routing(tokens, cat("positions"), categories, cat("attn"), cat("experts"), cat("bits"), cost)


def categorize(tokens: np.ndarray, prev: np.ndarray, log_prob: np.ndarray, eod: int, pieces: list[str]) -> np.ndarray:
    """CATEGORIES index per token (module docstring)."""
    text = list(pieces)
    rare_cut = np.quantile(log_prob[tokens], 0.10) if len(tokens) else -np.inf
    out = np.empty(len(tokens), dtype=np.int64)
    for i, (t, p) in enumerate(zip(tokens.tolist(), prev.tolist())):
        piece = text[t] if t < len(text) else ""
        word = piece.replace("\u2581", "")
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        non_ascii = False
        if byte:  # sentencepiece byte fallback: an ASCII character, or part of a rarer UTF-8 one
            code = int(byte.group(1), 16)
            word, non_ascii = (chr(code), False) if code < 128 else ("", True)
        before = text[p] if 0 <= p < len(text) else ""
        if p < 0 or p == eod or before.rstrip().endswith((".", "!", "?")) or before.endswith(("\n", "<0x0A>")):
            c = "sentence-initial"
        elif non_ascii:
            c = "rare/entity"
        elif any(ch.isdigit() for ch in word):
            c = "number"
        elif not any(ch.isalnum() for ch in word):
            c = "code symbol"
        elif piece.startswith("\u2581") and word.lower() in FUNCTION_WORDS:
            c = "function word"
        elif log_prob[t] <= rare_cut or (piece.startswith("\u2581") and word[:1].isupper()):
            c = "rare/entity"
        else:
            c = "content word"
        out[i] = CATEGORIES.index(c)
    return out


def depth_bands(n_layers: int, bands: int = 3) -> list[list[int]]:
    """Layers split into (at most) `bands` contiguous groups: early, middle, late."""
    return [list(map(int, b)) for b in np.array_split(np.arange(n_layers), min(bands, n_layers))]


def category_band_means(values: np.ndarray, categories: np.ndarray, bands: list[list[int]]) -> np.ndarray:
    """(categories, bands) mean of values (N, L) over the tokens of each category and the layers
    of each band; NaN where a category has no token."""
    out = np.full((len(CATEGORIES), len(bands)), np.nan)
    for c in range(len(CATEGORIES)):
        rows = categories == c
        if rows.any():
            for j, band in enumerate(bands):
                out[c, j] = values[rows][:, band].mean()
    return out


def routing_vectors(routing: Routing, n_bits: int, n_experts: int) -> np.ndarray:
    """Per token, over all layers: one-hot attention mode per head, expert multi-hot (real
    experts and the null), one-hot KV width."""
    N, L, H = routing.attn.shape
    parts = [np.eye(N_MODES)[routing.attn].reshape(N, L * H * N_MODES),
             np.eye(n_bits)[routing.bits].reshape(N, L * n_bits)]
    if routing.experts is not None:
        onehot = np.eye(n_experts + 1)[np.where(routing.experts < 0, n_experts, routing.experts)]
        parts.append(onehot.sum(2).reshape(N, L * (n_experts + 1)))
    return np.concatenate(parts, 1)


def kmeans(x: np.ndarray, k: int, seed: int = 0, iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with k-means++ seeding (deterministic for a seed): (labels, centres)."""
    rng = np.random.default_rng(seed)
    k = min(k, len(np.unique(x, axis=0)))
    centres = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d2 = np.min(((x[:, None, :] - np.array(centres)[None]) ** 2).sum(-1), 1)
        centres.append(x[rng.choice(len(x), p=d2 / d2.sum())])
    centres = np.array(centres, dtype=np.float64)
    labels = np.full(len(x), -1)
    for _ in range(iters):
        d2 = ((x[:, None, :] - centres[None]) ** 2).sum(-1)
        new = d2.argmin(1)
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            if (labels == j).any():
                centres[j] = x[labels == j].mean(0)
    return labels, centres


def mutual_information(a: np.ndarray, b: np.ndarray) -> float:
    """Plug-in mutual information (bits) of two discrete variables from paired samples."""
    _, ai = np.unique(a, return_inverse=True, axis=0 if a.ndim > 1 else None)
    _, bi = np.unique(b, return_inverse=True, axis=0 if b.ndim > 1 else None)
    ai, bi = ai.ravel(), bi.ravel()
    joint = np.zeros((ai.max() + 1, bi.max() + 1))
    np.add.at(joint, (ai, bi), 1.0)
    joint /= joint.sum()
    pa, pb = joint.sum(1, keepdims=True), joint.sum(0, keepdims=True)
    nz = joint > 0
    return float((joint[nz] * np.log2(joint[nz] / (pa @ pb)[nz])).sum())


def axis_codes(routing: Routing, layer: int) -> dict[str, np.ndarray]:
    """One discrete value per token and axis at `layer`: the tuple of head modes, the set of
    experts (sorted, null included), the KV width."""
    codes = {"attention": routing.attn[:, layer], "bits": routing.bits[:, layer]}
    if routing.experts is not None:
        codes["experts"] = np.sort(routing.experts[:, layer], 1)
    return codes


def cross_axis_mi(routing: Routing, seed: int = 0) -> dict[str, list[tuple[float, float]]]:
    """Per axis pair, per layer: (MI, MI with one axis shuffled across tokens). The shuffled value
    is the plug-in estimator's bias floor at this sample size (independent axes give about that)."""
    rng = np.random.default_rng(seed)
    out: dict[str, list[tuple[float, float]]] = {}
    for layer in range(routing.n_layers):
        codes = axis_codes(routing, layer)
        names = list(codes)
        for i in range(len(names)):
            for j in range(i + 1, len(names)):
                a, b = codes[names[i]], codes[names[j]]
                shuffled = b[rng.permutation(len(b))]
                out.setdefault(f"{names[i]}-{names[j]}", []).append((mutual_information(a, b),
                                                                    mutual_information(a, shuffled)))
    return out
