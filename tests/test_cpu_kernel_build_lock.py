"""The kernels' build lock: a build killed halfway (Ctrl-C or SIGKILL during a first start)
leaves torch's lock file behind, on which torch waits forever; the next start must remove it
and build, while a build that is still running is waited for, never broken into."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine import cpu_kernels
from engine.cpu_kernels import TORCH_BATON, build_lock

ROOT = Path(__file__).resolve().parents[1]

# A builder that takes the lock, creates torch's lock file as torch does, says so, then
# sleeps (to be killed) or, given a hold time, finishes as torch does (removing the file).
BUILDER = """
import sys, time
from pathlib import Path
import pytest

from engine import cpu_kernels
from engine.cpu_kernels import TORCH_BATON, build_lock
build_dir, hold = Path(sys.argv[1]), float(sys.argv[2])
with build_lock(build_dir):
    (build_dir / TORCH_BATON).touch()
    print("building", flush=True)
    time.sleep(hold)
    (build_dir / TORCH_BATON).unlink()
"""


def start_builder(build_dir: Path, hold_s: float) -> subprocess.Popen[str]:
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(build_dir), str(hold_s)],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert builder.stdout is not None
    assert builder.stdout.readline().strip() == "building"
    return builder


def test_a_killed_builds_lock_file_is_removed(tmp_path: Path) -> None:
    builder = start_builder(tmp_path, hold_s=60)
    builder.send_signal(signal.SIGKILL)
    builder.wait(timeout=10)
    assert (tmp_path / TORCH_BATON).exists()  # what torch would wait on forever
    with build_lock(tmp_path):
        assert not (tmp_path / TORCH_BATON).exists()


def test_a_running_build_is_waited_for(tmp_path: Path) -> None:
    builder = start_builder(tmp_path, hold_s=1.0)
    started = time.monotonic()
    entered: list[float] = []

    def take() -> None:
        with build_lock(tmp_path):
            entered.append(time.monotonic() - started)

    taker = threading.Thread(target=take)
    taker.start()
    taker.join(timeout=30)
    builder.wait(timeout=30)
    # The builder removed its own lock file (had the taker broken in and removed it, the
    # builder's unlink would have failed), and the taker got in only after that.
    assert builder.returncode == 0
    assert len(entered) == 1 and entered[0] >= 0.5


def test_no_lock_file_is_left_behind(tmp_path: Path) -> None:
    with build_lock(tmp_path / "fresh"):
        pass
    assert not (tmp_path / "fresh" / TORCH_BATON).exists()
    with build_lock(tmp_path / "fresh"):  # and the lock can be taken again
        pass


def test_every_checkout_builds_from_the_same_staged_copies(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # ninja rebuilds when a command line changes, and it names the sources' paths: staged
    # copies at one place per build make every checkout with the same sources share it.
    build_dir = tmp_path / "build"
    staged = cpu_kernels._stage_sources(build_dir)
    assert [p.parent for p in staged] == [build_dir / "src"] * len(cpu_kernels.SOURCES)
    assert all(p.read_bytes() == s.read_bytes()
               for p, s in zip(staged, cpu_kernels.SOURCES, strict=True))
    assert (build_dir / "src" / "vec_math.h").is_file()  # the sources include it
    stamps = [p.stat().st_mtime_ns for p in staged]
    time.sleep(0.01)
    # Another checkout (same contents, another path): nothing is rewritten, ninja sees
    # the same commands and files and does nothing.
    other = tmp_path / "other-checkout"
    other.mkdir()
    copies = []
    for source in cpu_kernels.SOURCES:
        copies.append(other / source.name)
        copies[-1].write_bytes(source.read_bytes())
    monkeypatch.setattr(cpu_kernels, "SOURCES", copies)
    assert cpu_kernels._stage_sources(build_dir) == staged
    assert [p.stat().st_mtime_ns for p in staged] == stamps
    copies[0].write_bytes(copies[0].read_bytes() + b"\n// changed\n")  # a changed source
    cpu_kernels._stage_sources(build_dir)
    assert staged[0].read_bytes().endswith(b"// changed\n")
    assert [p.stat().st_mtime_ns for p in staged[1:]] == stamps[1:]


def test_a_finished_build_is_marked_and_loaded_as_is_from_any_environment() -> None:
    # ninja would rebuild for another venv (its torch headers' path is in the commands):
    # a build marked finished is loaded directly, its name holding what it depends on.
    if not cpu_kernels._build():
        pytest.skip("the CPU kernels cannot be built here")
    name = f"loragate_cpu_kernels_{cpu_kernels._build_tag()}"
    build_dir = cpu_kernels.build_directory(name)
    assert (build_dir / cpu_kernels.BUILT_MARK).is_file()
    assert (build_dir / f"{name}.so").is_file()
