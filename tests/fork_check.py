"""One check for code that forks: SIGKILL the process that forked, and its forks must die with it
and must not hold its stdout open (a launcher reading it, srun, would wait for them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def assert_forks_die_with_their_process(code: str, forks: int, timeout: float = 10) -> None:
    """Runs `code` (which prints "ready" once its `forks` descendants exist, then sleeps), SIGKILLs
    it, and asserts its stdout reaches EOF and every descendant is dead within `timeout` seconds."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + timeout
        found = []
        while len(found) < forks and time.monotonic() < deadline:
            found = descendants(proc.pid)
            time.sleep(0.05)
        assert len(found) == forks, found
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout)
        reader = threading.Thread(target=proc.stdout.read, daemon=True)
        reader.start()
        reader.join(timeout)
        assert not reader.is_alive(), "the killed process's stdout is still held open by a fork"
        deadline = time.monotonic() + timeout
        while any(alive(pid) for pid in found) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in found), f"forks {found} outlived their process"
    finally:
        if proc.poll() is None:
            proc.kill()


def descendants(pid: int) -> list[int]:
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return children + [d for c in children for d in descendants(c)]


def alive(pid: int) -> bool:
    try:  # a zombie waiting for init to reap it is dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
