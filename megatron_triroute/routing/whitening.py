"""Per-axis whitening (Eq. whiten).

Eq. whiten standardises the trunk output with detached running statistics per axis. Applied
literally to the *same* trunk output h, the three axes' statistics would be identical (same
tensor, same tokens), and "per-axis" would mean nothing. Our choice (not the paper's): each
axis whitens its own head's pre-bias projection u^axis = W_axis h_hat, per output unit,

    z^axis = gain * (u^axis - sg(mu^axis)) / sg(sigma^axis + eps) + bias,

so mu/sigma are statistics of three different quantities (attention per head x mode, expert
options, bit options). This keeps the property the paper wants: if one axis collapses, the
scale of another axis's logits across tokens is restored to ~1 by its own statistics, so it
stays discriminative; the learned gain and bias keep full expressiveness (at init mu = 0,
sigma = 1 and the head equals a plain linear head).

Statistics follow `running_stats`: read as they were before this batch, fp32, accumulated in
float64 over the global batch, committed once per optimizer step with EMA momentum m.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from triroute_kernels import HAS_TRITON, takes_cpu_kernel

from .device_values import device_constant, to_device
from .kernel_check import checked_once, first_use_probe
from .running_stats import RunningStatistic
from .versions import version_key


class RunningWhitening(RunningStatistic):
    """Standardise the last dim with running mean/std from previous optimizer steps."""

    def __init__(self, num_features: int, momentum: float = 0.99, eps: float = 1e-5):
        super().__init__()
        self.momentum = momentum
        self.eps = eps
        self.register_buffer("mean", torch.zeros(num_features, dtype=torch.float32))
        self.register_buffer("var", torch.ones(num_features, dtype=torch.float32))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        # Accumulator: [count, sum(D), sum of squares(D)], float64.
        self.register_buffer("_acc", torch.zeros(1 + 2 * num_features, dtype=torch.float64), persistent=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return RunningWhitening.whiten_all([self], u)

    @classmethod
    def whiten_all(cls, modules: list["RunningWhitening"], u: torch.Tensor) -> torch.Tensor:
        """`forward` of every module in `modules` on its own features of u (their features laid end
        to end along the last dim), as one computation: one statistics pass, one accumulation into
        every module's accumulator, one standardisation. The modules must share `eps` (checked by
        `standardisation`)."""
        one = len(modules) == 1
        if modules[0].should_accumulate():
            # the rows as they come: the controller's training node passes 2-D rows tracking nothing
            flat = u.detach() if u.requires_grad else u
            if flat.dim() != 2:
                flat = flat.reshape(-1, flat.shape[-1])
            flat = flat.to(torch.float64)
            # [count, sums(D), squares(D)] of the whole width: one module's accumulator layout (the
            # count a constant of the shape)
            count = device_constant((float(flat.shape[0]),), torch.float64, flat.device)
            stats = torch.cat([count, flat.sum(0), flat.pow(2).sum(0)])
            if one:
                modules[0]._acc.add_(stats)
            else:  # each module's [count, sum(d), squares(d)], end to end
                widths = tuple(m.mean.numel() for m in modules)
                pieces = stats.index_select(0, _accumulator_order(widths, u.device)).split([1 + 2 * d for d in widths])
                torch._foreach_add_([m._acc for m in modules], list(pieces))
        mean, denom = cls.standardisation(modules)
        return ((u.float() - mean) / denom).to(u.dtype)  # buffers: no gradient to stop

    @staticmethod
    def standardisation(modules: list["RunningWhitening"]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std + eps) of `modules`' features laid end to end, as `whiten_all` divides by them.
        They change once per optimizer step (`commit_all`) or on a load, and a layer reads them in
        every forward and backward: kept on the first module under `version_key` of every module's
        mean and var, with those tensors themselves (so a replaced one's address is never reused
        while the key names it). The modules must share `eps`: every path that whitens several
        modules together (`whiten_all`, the controller's whitened heads) divides by this."""
        sources = tuple(t for m in modules for t in (m.mean, m.var))
        key = version_key(sources)
        kept = modules[0].__dict__.get("_standardisation")
        if kept is not None and kept[0] == key:
            return kept[2], kept[3]
        if any(m.eps != modules[0].eps for m in modules):
            raise ValueError(f"whitening modules whitened together must share eps, got {[m.eps for m in modules]}")
        one = len(modules) == 1
        mean = modules[0].mean if one else torch.cat([m.mean for m in modules])
        var = modules[0].var if one else torch.cat([m.var for m in modules])
        denom = var.sqrt() + modules[0].eps
        modules[0].__dict__["_standardisation"] = (key, sources, mean, denom)
        return mean, denom

    def pending(self) -> torch.Tensor:
        return self._acc

    def batch_key(self) -> object:
        return (RunningWhitening, self.momentum, self.mean.device)

    @torch.no_grad()
    def commit(self, reduced: torch.Tensor) -> None:
        RunningWhitening.commit_all([self], [reduced])

    @classmethod
    @torch.no_grad()
    def commit_all(cls, stats: list["RunningWhitening"], reduced: list[torch.Tensor]) -> None:
        """The EMA update of every module in `stats` (one momentum) as one batched computation over
        their features laid end to end; each feature reads its own module's token count. One kernel
        call where one takes the tensors (`_commit_kernel`), else `commit_torch` (the definition)."""
        kernel = _commit_kernel(stats, reduced)
        if kernel is None:
            cls.commit_torch(stats, reduced)
        else:
            kernel(reduced, [w.mean for w in stats], [w.var for w in stats], [w.steps for w in stats],
                   [w._acc for w in stats], stats[0].momentum)

    @staticmethod
    @torch.no_grad()
    def commit_torch(stats: list["RunningWhitening"], reduced: list[torch.Tensor]) -> None:
        """`commit_all` as tensor ops: the definition."""
        widths = [w.mean.numel() for w in stats]
        count_at, sum_at, square_at, module_count_at = _feature_indices(tuple(widths), stats[0].mean.device)
        flat = torch.cat(reduced)  # [count, sum(D), sum of squares(D)] per module, end to end
        torch._foreach_zero_([w._acc for w in stats])
        counts = flat[count_at]  # (sum D,): each feature's module count
        # No tokens this step: every statistic kept. Selects, not a branch: no host read of the count.
        seen = counts > 0
        count = counts.clamp_min(1.0)
        batch_mean = flat[sum_at] / count
        batch_var = (flat[square_at] / count - batch_mean.pow(2)).clamp_min(0.0)
        m = stats[0].momentum
        for name, batch in (("mean", batch_mean), ("var", batch_var)):
            old = torch.cat([getattr(w, name) for w in stats])
            new = torch.where(seen, (m * old.double() + (1 - m) * batch).float(), old)
            torch._foreach_copy_([getattr(w, name) for w in stats], list(new.split(widths)))
        module_seen = flat[module_count_at] > 0
        torch._foreach_add_([w.steps for w in stats], list(module_seen.to(torch.int64).unbind()))


def _commit_kernel(stats: list[RunningWhitening], reduced: list[torch.Tensor]) -> Callable | None:
    """The kernel committing these modules, called as kernel(reduced, means, vars, step counts,
    accumulators, momentum): `torch.ops.triroute.whitening_commit` on a CPU (where built), the Triton
    kernel of `triroute_kernels.triton_whiten` on a GPU (once its first use has given the
    definition's values); None where the tensor ops serve."""
    mean = stats[0].mean
    if not (all(w.mean.dtype == w.var.dtype == torch.float32 and w.mean.is_contiguous() and w.var.is_contiguous()
                for w in stats)
            and all(r.dtype == torch.float64 and r.is_contiguous() for r in reduced)):
        return None
    if takes_cpu_kernel(mean):
        return torch.ops.triroute.whitening_commit
    if mean.is_cuda and HAS_TRITON and not torch.compiler.is_compiling():
        return checked_once(("whitening commit", str(mean.device)), lambda: _checked_commit(mean.device))
    return None


def _checked_commit(device: torch.device) -> Callable | None:
    """The Triton commit once it has given the definition's statistics, step counts and zeroed
    accumulators on a probe (modules with tokens, one without); else None with a warning."""
    def load() -> Callable:
        from triroute_kernels.triton_whiten import whitening_commit_triton

        return whitening_commit_triton

    def agrees(kernel: Callable) -> bool:
        gen = torch.Generator().manual_seed(0)
        pairs = [[RunningWhitening(d, momentum=0.9).to(device) for d in (5, 3, 4)] for _ in range(2)]
        reduced = []
        for i, (a, b) in enumerate(zip(*pairs)):
            for m in (a, b):
                m.mean.copy_(torch.randn(m.mean.shape, generator=torch.Generator().manual_seed(i)))
                m._acc.fill_(1.0)
            d = a.mean.numel()
            rows = torch.randn(7, d, generator=gen, dtype=torch.float64) * 2 + 1
            count = 0.0 if i == 1 else 7.0
            reduced.append(torch.cat([torch.tensor([count], dtype=torch.float64), rows.sum(0),
                                      rows.pow(2).sum(0)]).to(device))
        kernel(reduced, [w.mean for w in pairs[0]], [w.var for w in pairs[0]], [w.steps for w in pairs[0]],
               [w._acc for w in pairs[0]], 0.9)
        RunningWhitening.commit_torch(pairs[1], reduced)
        return all(torch.equal(getattr(a, n), getattr(b, n))
                   for a, b in zip(*pairs) for n in ("mean", "var", "steps", "_acc"))

    return first_use_probe(device, "the whitening's commit", load, agrees)


@functools.lru_cache(maxsize=None)
def _feature_indices(widths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """For modules of `widths` features whose accumulators [count, sum(d), sum of squares(d)] lie
    end to end: each feature's index of its module's count, of its sum and of its sum of squares,
    and each module's index of its count (built once per layout and device, copied there without a
    stream synchronise: `device_values.to_device`)."""
    count_at, sum_at, square_at, module_count_at, start = [], [], [], [], 0
    for d in widths:
        module_count_at.append(start)
        count_at += [start] * d
        sum_at += range(start + 1, start + 1 + d)
        square_at += range(start + 1 + d, start + 1 + 2 * d)
        start += 1 + 2 * d
    return tuple(to_device(i, torch.int64, device) for i in (count_at, sum_at, square_at, module_count_at))


@functools.lru_cache(maxsize=None)
def _accumulator_order(widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """For modules of `widths` features: where each entry of their accumulators laid end to end
    ([count, sum(d), sum of squares(d)] per module) lies in [count, sums(D), squares(D)] of their
    features together (D = sum of widths)."""
    total, order, start = sum(widths), [], 0
    for d in widths:
        order += [0, *range(1 + start, 1 + start + d), *range(1 + total + start, 1 + total + start + d)]
        start += d
    return to_device(order, torch.int64, device)
