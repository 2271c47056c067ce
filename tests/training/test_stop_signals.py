"""Stop signals only set a flag; a real SIGUSR1/SIGTERM to a subprocess leads to a clean EXIT_REQUEUE."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_triroute.training import signals

REPO = Path(__file__).resolve().parents[2]

# Installs the handlers before `import torch`, as real entry points must, then loops in steps.
WORKER = """
import sys, time
from megatron_triroute.training.signals import EXIT_FINISHED, EXIT_REQUEUE, install_stop_handlers, stop_requested, stop_signal
install_stop_handlers()
import torch  # the slow import a signal may interrupt
print("ready", flush=True)
for step in range(1, 600):
    time.sleep(0.05)
    if stop_requested():
        print(f"stopping after step {step} on signal {stop_signal()}", flush=True)
        sys.exit(EXIT_REQUEUE)
sys.exit(EXIT_FINISHED)
"""


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_real_signal_sets_flag_and_worker_exits_requeue(signum):
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout.readline().strip() == "ready"
        worker.send_signal(signum)
        out, err = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == signals.EXIT_REQUEUE, err
    assert f"on signal {int(signum)}" in out


def test_signal_during_slow_import_is_not_fatal():
    # A signal arriving before the loop (during `import torch`) is remembered, not fatal.
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER], env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True
    )
    try:
        time.sleep(0.3)  # interpreter start + handlers, typically inside `import torch`
        worker.send_signal(signal.SIGUSR1)
        out, _ = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == signals.EXIT_REQUEUE, out
    assert "stopping after step 1 " in out


def test_handler_only_sets_flag():
    previous = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    try:
        signals.clear_stop_request()
        signals.install_stop_handlers()
        assert not signals.stop_requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.stop_requested() and signals.stop_signal() == signal.SIGUSR1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signals.clear_stop_request()


def test_stop_agreed_with_any_rank_flag():
    signals.clear_stop_request()
    try:
        assert signals.stop_agreed(lambda local: max(local, 0)) is False  # nobody asked
        assert signals.stop_agreed(lambda local: max(local, 1)) is True  # another rank asked
        assert signals.stop_requested()  # and this rank now knows
    finally:
        signals.clear_stop_request()


def test_exit_codes():
    assert (signals.EXIT_FINISHED, signals.EXIT_REQUEUE) == (0, 75)


HEAVY_CHECK = "import sys; {load}; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"


def test_signals_module_imports_nothing_heavy():
    load = (
        "import importlib.util as u; spec = u.spec_from_file_location('signals', {path!r}); "
        "spec.loader.exec_module(u.module_from_spec(spec))"
    ).format(path=signals.__file__)
    out = subprocess.run([sys.executable, "-c", HEAVY_CHECK.format(load=load)], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_importing_signals_through_the_package_imports_nothing_heavy():
    code = HEAVY_CHECK.format(load="import megatron_triroute.training.signals")
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True
    )
    assert out.stdout.strip() == "[]", out.stderr
