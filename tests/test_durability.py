"""Crash tests of the durability primitives: a child process is killed (os._exit) after every step of
a directory publish and of an atomic write; the old or the new state is then whole, never neither."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_triroute import durability as d

REPO = Path(__file__).resolve().parents[1]

OLD = {"a.bin": b"old-a" * 100, "b.json": b'{"v": "old"}'}
NEW = {"a.bin": b"new-a" * 300, "b.json": b'{"v": "new"}', "c.txt": b"only in new"}

CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from megatron_triroute import durability as d
    root, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "publish":
        d.remove_stale_tmp(root, "out")  # as every caller does before a new attempt
        tmp = root / ("out" + d.TMP_MARK + "1")
        tmp.mkdir()
        for name, text in json.loads(sys.argv[3]).items():
            d.write_durably(tmp / name, text.encode("latin-1"))
        d.publish_dir(tmp, root / "out")
    else:
        d.write_bytes_atomic(root / "file.bin", sys.argv[3].encode("latin-1"))
    print("returned", flush=True)
    """
)


def run_child(root: Path, mode: str, payload: str, crash_at: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(d.CRASH_ENV, None)
    if crash_at is not None:
        env[d.CRASH_ENV] = crash_at
    return subprocess.run([sys.executable, "-c", CHILD, str(root), mode, payload], env=env,
                          capture_output=True, text=True, timeout=60)


def as_payload(files: dict[str, bytes]) -> str:
    return json.dumps({k: v.decode("latin-1") for k, v in files.items()})


def read_dir(path: Path | None) -> dict[str, bytes] | None:
    if path is None:
        return None
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def make_old(root: Path) -> None:
    out = root / "out"
    out.mkdir(parents=True)
    for name, data in OLD.items():
        (out / name).write_bytes(data)


# Which state each kill point must leave: the new directory is in place only after its rename.
PUBLISH_STEPS = {"synced": OLD, "aside": OLD, "swapped": NEW, "discarding": NEW}


@pytest.mark.parametrize("step", list(PUBLISH_STEPS))
def test_publish_killed_after_each_step_leaves_old_or_new_whole(tmp_path, step):
    make_old(tmp_path)
    done = run_child(tmp_path, "publish", as_payload(NEW), step)
    assert done.returncode == d.CRASH_EXIT_CODE, done.stdout + done.stderr
    assert "returned" not in done.stdout

    # Before any repair, a read-only reader finds one whole state (the old one under its aside name).
    assert read_dir(d.resolve_dir(tmp_path / "out")) == PUBLISH_STEPS[step]
    if step == "aside":
        assert not (tmp_path / "out").exists() and d.aside_path(tmp_path / "out").is_dir()
    if step == "discarding":  # the half-deleted old directory is only ever the aside
        assert len(read_dir(d.aside_path(tmp_path / "out"))) == len(OLD) - 1

    d.recover_dir(tmp_path / "out")
    assert read_dir(tmp_path / "out") == PUBLISH_STEPS[step]
    assert not d.aside_path(tmp_path / "out").exists()

    # The next publish (a resumed run) starts from the repaired state and replaces it.
    again = {"a.bin": b"third"}
    done = run_child(tmp_path, "publish", as_payload(again), None)
    assert done.returncode == 0, done.stderr
    assert read_dir(tmp_path / "out") == again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_publish_without_recovery_first_repairs_an_interrupted_one(tmp_path):
    make_old(tmp_path)
    assert run_child(tmp_path, "publish", as_payload(NEW), "aside").returncode == d.CRASH_EXIT_CODE
    # publish_dir itself calls recover_dir, so a caller that forgets still never loses the old state.
    assert run_child(tmp_path, "publish", as_payload({"x": b"1"}), None).returncode == 0
    assert read_dir(tmp_path / "out") == {"x": b"1"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("step", ["synced", "swapped"])
def test_first_publish_killed_leaves_nothing_or_new(tmp_path, step):
    done = run_child(tmp_path, "publish", as_payload(NEW), step)
    assert done.returncode == d.CRASH_EXIT_CODE, done.stderr
    assert read_dir(d.resolve_dir(tmp_path / "out")) == (None if step == "synced" else NEW)


@pytest.mark.parametrize("step,expected", [("tmp_written", b"old"), ("replaced", b"new" * 1000)])
def test_atomic_write_killed_after_each_step(tmp_path, step, expected):
    (tmp_path / "file.bin").write_bytes(b"old")
    done = run_child(tmp_path, "write", "new" * 1000, step)
    assert done.returncode == d.CRASH_EXIT_CODE, done.stderr
    assert (tmp_path / "file.bin").read_bytes() == expected
    d.remove_stale_tmp(tmp_path, "file.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin"]


def test_checksums_detect_truncation_and_corruption(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    record = d.describe_file(path)
    # sha256("abc") from FIPS 180-2, appendix B.1
    assert record == {"bytes": 3, "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"}
    assert d.check_file(path, record) is None
    path.write_bytes(b"abd")
    assert "sha256 does not match" in d.check_file(path, record)
    assert d.check_file(path, record, hashes=False) is None
    path.write_bytes(b"ab")
    assert "is 2 bytes, manifest says 3" in d.check_file(path, record)
    path.unlink()
    assert "f is missing" in d.check_file(path, record)
