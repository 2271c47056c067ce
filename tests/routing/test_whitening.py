import pytest
import torch

from megatron_triroute.routing.whitening import RunningWhitening
from tests.dispatched import DispatchedOps
from triroute_kernels import cpu_ops_available

from .test_running_stats import _filled_modules


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ kernels are not built here")
def test_the_commit_kernel_gives_the_definitions_statistics_in_one_call():
    """`commit_all` on a CPU: one `whitening_commit` call, and the definition's (`commit_torch`) means,
    variances, step counts and zeroed accumulators bit for bit, a module that saw no token kept."""
    got, want = _filled_modules(7)[0], _filled_modules(7)[0]
    reduced = [w._acc.clone() for w in got]
    with DispatchedOps() as ops:
        RunningWhitening.commit_all(got, reduced)
    assert ops.names == ["whitening_commit"]
    RunningWhitening.commit_torch(want, [w._acc.clone() for w in want])
    for a, b in zip(got, want):
        for name in ("mean", "var", "steps", "_acc"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not got[0]._acc.any() and got[2].steps.item() == 2  # module 2 saw no token: its step count kept
    assert not torch.equal(got[0].mean, _filled_modules(7)[0][0].mean)  # the others moved


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ kernels are not built here")
def test_the_commit_kernel_moves_the_statistics_versions_so_the_kept_divisor_is_made_again():
    """What `standardisation` keeps is keyed on the statistics' versions: a commit written by the
    kernel must move them as an in-place op does, or the next forward divides by last step's std."""
    w = _filled_modules(1)[0]
    before = RunningWhitening.standardisation(w)[1].clone()
    versions = [(m.mean._version, m.var._version, m.steps._version, m._acc._version) for m in w]
    RunningWhitening.commit_all(w, [m._acc.clone() for m in w])
    assert all(all(a > b for a, b in zip((m.mean._version, m.var._version, m.steps._version, m._acc._version), v))
               for m, v in zip(w, versions))
    after = RunningWhitening.standardisation(w)[1]
    assert torch.equal(after, torch.cat([m.var for m in w]).sqrt() + w[0].eps) and not torch.equal(after, before)


def test_whitening_several_modules_together_refuses_different_eps_on_every_path():
    """The one check, in `standardisation`, which every path dividing by the first module's eps reads:
    the tensor ops' `whiten_all` and the whitened heads (kernel or not) both refuse the modules."""
    from megatron_triroute.routing.whitened_heads import whitened_heads

    u = torch.randn(4, 5)
    for run in (lambda ws: RunningWhitening.whiten_all(ws, u),
                lambda ws: whitened_heads(ws, u, [torch.ones(2), torch.ones(3)], [torch.zeros(2), torch.zeros(3)])):
        with pytest.raises(ValueError, match="must share eps"):
            run([RunningWhitening(2, eps=1e-5), RunningWhitening(3, eps=1e-3)])
        run([RunningWhitening(2, eps=1e-3), RunningWhitening(3, eps=1e-3)])  # one eps: accepted
