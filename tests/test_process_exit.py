"""`exit_process`: a process's status, atexit handlers and buffered output survive it; live objects
are frozen before the interpreter's final collections; the command-line entry points end with it."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import atexit, gc, sys
    from megatron_triroute.process_exit import exit_process

    cycle = []
    cycle.append(cycle)  # a live cycle, as every imported module holds
    out = open(sys.argv[1], "w")  # buffered, never closed explicitly
    out.write("buffered line")
    atexit.register(lambda: print(f"atexit ran; frozen {gc.get_freeze_count()} objects", flush=True))
    exit_process(int(sys.argv[2]))
    """
)


@pytest.mark.parametrize("status", [0, 2, 75])
def test_status_atexit_and_buffered_files_survive_and_objects_are_frozen(tmp_path, status):
    target = tmp_path / "out.txt"
    run = subprocess.run([sys.executable, "-c", CHILD, str(target), str(status)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == status, run.stderr
    line = run.stdout.strip()
    assert line.startswith("atexit ran; frozen "), run.stdout + run.stderr
    assert int(line.split()[3]) > 1000  # every live object, not none
    assert target.read_text() == "buffered line"


@pytest.mark.parametrize("path", [
    "megatron_triroute/train.py", "megatron_triroute/evaluate.py", "megatron_triroute/generate.py",
    "megatron_triroute/export/__main__.py", "megatron_triroute/sweep.py", "megatron_triroute/analyze.py",
    "megatron_triroute/overhead.py", "megatron_triroute/lm_eval_harness.py", "data_prep/__main__.py",
])
def test_every_command_line_entry_point_ends_with_it(path):
    main_block = (REPO / path).read_text().split('if __name__ == "__main__":', 1)[1]
    assert "exit_process(" in main_block and "sys.exit(" not in main_block, path


def test_forked_children_and_grandchildren_die_with_the_process_and_free_its_output():
    """After children_die_with_this_process, a SIGKILLed process leaves no fork behind holding its
    stdout (srun would wait for it): the child and the child's child die with their parents."""
    from tests.fork_check import assert_forks_die_with_their_process

    code = ("import multiprocessing, os, time\n"
            "from megatron_triroute.process_exit import children_die_with_this_process\n"
            "children_die_with_this_process()\n"
            "def grandchild():\n    time.sleep(600)\n"
            "def child():\n    multiprocessing.get_context('fork').Process(target=grandchild).start()\n"
            "    time.sleep(600)\n"
            "multiprocessing.get_context('fork').Process(target=child).start()\n"
            "print('ready', flush=True)\ntime.sleep(600)\n")
    assert_forks_die_with_their_process(code, forks=2)  # the child, then its child
