"""The shared-trunk controller's logits with a hand-derived backward, for training.

    x = [RMSNorm(hidden; w_in); psi],  h = RMSNorm(W2 gelu(W1 x + b1) + b2; w_h),
    u = W h (every head's projection stacked),  z = gain * whiten(u) + bias

is what `Trunk` and `RouterHead` compute with autograd (the definition); this computes the same
forward (the same ops in the same order, except every head's projection as one matmul over the
stacked heads, which a BLAS may block otherwise than one head's: equal up to float32 rounding, bit
for bit on some CPUs only) and one backward for all of it
(`tests/routing/test_trunk_grad.py` compares the two, values and every gradient, and counts the
ops: 66 for a forward and backward where the modules under autograd dispatch 209, on a CPU where
the C++ kernels are built). The backward:

    dbias = sum_rows dz,  dgain = sum_rows dz * s,  du = dz * (gain / (std + eps)),
    dW = du^T h,  dh = du W,
    RMSNorm (y = w * x r, r = rsqrt(mean(x^2) + eps)):  dw = sum_rows dy * x r,
        dx = r (g - x r mean(g * x r)),  g = dy * w,
    dW2 = dt^T a, db2 = sum_rows dt, da = dt W2,  dpre = gelu'(pre) da,  dW1 = dpre^T x, ...

The whitening statistics are detached buffers (no gradient through them); they accumulate in the
forward as `RunningWhitening.whiten_all` does, and the heads' whitening, gain and bias run as one
kernel call each way where one is built (`whitened_heads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triroute_kernels import takes_cpu_kernel

from .whitened_heads import heads_backward_torch, whitened_heads


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x; weight), rstd): `nn.RMSNorm`'s values with the reciprocal RMS kept for the backward.
    PyTorch's fused op (one kernel on a GPU; six tensor ops on a CPU, which has no kernel for it);
    on a CPU where the C++ kernels are built, `torch.ops.triroute.rms_norm_rstd` in one call (equal up
    to the order of the sum of squares; it has no autograd formula: taken where nothing tracks one,
    as in `SharedTrunkLogits.forward`)."""
    tracked = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not tracked and x.dim() == 2 and takes_cpu_kernel(x) and weight.dtype == torch.float32:
        return torch.ops.triroute.rms_norm_rstd(x.contiguous(), weight.contiguous(),
                                                eps if eps is not None else torch.finfo(x.dtype).eps)
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)


def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                       weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of y = weight * x rstd over the last dim (rows: every other dim), in the
    promoted dtype of dy, x and weight. On a GPU, PyTorch's fused kernel (the one autograd takes
    for `_fused_rms_norm` there: one pass over the rows instead of seven elementwise ones), all
    operands in that dtype; on a CPU, where PyTorch has no kernel for it, the C++ kernel
    `torch.ops.triroute.rms_norm_backward` (float32 rows, where built); elsewhere the formula as
    tensor ops (`_rms_norm_torch_backward`, the definition)."""
    if dy.is_cuda:
        dtype = torch.promote_types(torch.promote_types(dy.dtype, x.dtype), weight.dtype)
        dx, d_weight = torch.ops.aten._fused_rms_norm_backward(
            dy.to(dtype), x.to(dtype), [x.shape[-1]], rstd, weight.to(dtype), [True, True])
        return dx, d_weight
    if x.dim() == 2 and takes_cpu_kernel(x) and dy.dtype == weight.dtype == rstd.dtype == torch.float32 \
            and dy.stride(-1) == 1:
        return torch.ops.triroute.rms_norm_backward(dy, x.contiguous(), rstd.contiguous(), weight.contiguous())
    return _rms_norm_torch_backward(dy, x, rstd, weight)


def _rms_norm_torch_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                             weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_rms_norm_backward` as tensor ops."""
    x_hat = x * rstd
    d_weight = (dy * x_hat).sum(0)
    g = dy * weight
    dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    return dx, d_weight


class SharedTrunkLogits(torch.autograd.Function):
    """z (N, sum of the heads' sizes) of rows hidden (N, D), side (N, F); see the module doc.
    `meta` = (the heads' `RunningWhitening` modules or None, the input norm's eps, the trunk norm's
    eps, the number of heads n); then the input norm's weight, fc1's weight and bias, fc2's weight
    and bias, the trunk norm's weight; then the heads' projection weights (n), their gains (n, with
    whitening only) and their biases (n)."""

    @staticmethod
    def forward(ctx, meta, hidden, side, w_in, w1, b1, w2, b2, w_h, *head_params):
        whiten, eps_in, eps_h, n_heads = meta
        proj = head_params[:n_heads]
        gain = head_params[n_heads:2 * n_heads] if whiten is not None else ()
        bias = head_params[len(head_params) - n_heads:]
        x_n, r_in = _rms_norm(hidden, w_in, eps_in)
        x = torch.cat([x_n, side], -1)
        pre = F.linear(x, w1, b1)
        a = F.gelu(pre)
        t = F.linear(a, w2, b2)
        h, r_h = _rms_norm(t, w_h, eps_h)
        weight = torch.cat(proj) if n_heads > 1 else proj[0]
        u = F.linear(h, weight)
        ctx.heads_backward = None
        if whiten is not None:
            z, s, denom, ctx.heads_backward = whitened_heads(whiten, u, list(gain), list(bias))
        else:
            z, s, denom = u + (torch.cat(bias) if n_heads > 1 else bias[0]), None, None
        ctx.meta = meta
        ctx.sizes = [p.shape[0] for p in proj]
        ctx.side_grad = side.requires_grad
        ctx.save_for_backward(hidden, r_in, w_in, x, w1, pre, a, w2, t, r_h, w_h, h, weight, s, denom, *gain)
        return z

    @staticmethod
    def backward(ctx, dz):
        hidden, r_in, w_in, x, w1, pre, a, w2, t, r_h, w_h, h, weight, s, denom, *gain = ctx.saved_tensors
        whiten, _, _, n_heads = ctx.meta
        split = lambda g: g.split(ctx.sizes) if n_heads > 1 else (g,)  # noqa: E731
        if whiten is None:
            du, d_gain, d_bias = dz, (), split(dz.sum(0))
        elif ctx.heads_backward is not None and dz.dtype == torch.float32 and dz.stride(-1) == 1 \
                and dz.stride(0) >= dz.shape[1]:
            du, d_gain, d_bias = ctx.heads_backward(dz, s, denom, gain)
        else:
            du, d_gain, d_bias = heads_backward_torch(dz, s, denom, gain)
        d_weight = du.t().mm(h)
        dh = du.mm(weight)
        dt, d_wh = _rms_norm_backward(dh, t, r_h, w_h)
        d_w2, d_b2, da = dt.t().mm(a), dt.sum(0), dt.mm(w2)
        d_pre = torch.ops.aten.gelu_backward(da, pre)
        d_w1, d_b1, dx = d_pre.t().mm(x), d_pre.sum(0), d_pre.mm(w1)
        D = hidden.shape[-1]
        d_hidden, d_win = _rms_norm_backward(dx[:, :D], hidden, r_in, w_in)
        d_side = dx[:, D:] if ctx.side_grad else None
        return (None, d_hidden, d_side, d_win, d_w1, d_b1, d_w2, d_b2, d_wh, *split(d_weight), *d_gain, *d_bias)


def run_forward_pre_hooks(modules) -> None:
    """Each module's forward pre-hooks, without its forward: for code that reads a module's
    parameters without calling it. A data-parallel engine that all-gathers parameters while the
    forward runs (Megatron-Core's distributed optimizer with `overlap_param_gather`) waits for a
    module's parameters in such a hook; without it the read could see last step's values."""
    for m in modules:
        for key, hook in m._forward_pre_hooks.items():
            if key in m._forward_pre_hooks_with_kwargs:
                hook(m, (), {})
            else:
                hook(m, ())


def shared_trunk_logits(hidden: torch.Tensor, side: torch.Tensor, input_norm, trunk, heads: list) -> torch.Tensor:
    """z (..., sum of the heads' sizes) of the controller's modules: `input_norm` (RMSNorm), `trunk`
    (`Trunk`), `heads` (`RouterHead`s, all whitened or none), through `SharedTrunkLogits`."""
    whiten = [hd.whiten for hd in heads] if heads[0].whiten is not None else None
    params = [hd.proj.weight for hd in heads]
    if whiten is not None:  # (sharing one eps: `RunningWhitening.standardisation` checks)
        params += [hd.gain for hd in heads]
    params += [hd.bias for hd in heads]
    run_forward_pre_hooks([input_norm, trunk.fc1, trunk.fc2, trunk.norm, *heads, *(hd.proj for hd in heads)])
    meta = (whiten, input_norm.eps, trunk.norm.eps, len(heads))
    z = SharedTrunkLogits.apply(meta, hidden.reshape(-1, hidden.shape[-1]), side.reshape(-1, side.shape[-1]),
                                input_norm.weight, trunk.fc1.weight, trunk.fc1.bias, trunk.fc2.weight,
                                trunk.fc2.bias, trunk.norm.weight, *params)
    return z.view(*hidden.shape[:-1], z.shape[-1])
