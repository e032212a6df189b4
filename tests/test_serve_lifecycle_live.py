"""How `loragate serve` starts and stops, against live processes: a busy port or an
unreachable store refused before any engine starts, engine log directories removed after a
clean exit (kept and shown after a failure), engines that do not outlive a gateway killed
outright, engines started together splitting the cores, a stop while engines load, and
the load progress printed while waiting."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.serve import EngineProcess, free_port, wait_ready
from gateway.sqlite_store import SqliteStore
from tests.test_parent_watch import alive


def serve_command(model: Path, port: int, *extra: str) -> list[str]:
    """`loragate serve` with its one engine in a process of its own (--engine-process)."""
    return [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model), "--port",
            str(port), "--instances", "1", "--engine-process", "--num-kv-blocks", "64",
            *extra]


def serve_env(tmp: Path) -> dict[str, str]:
    """The environment of a `loragate serve` child whose temp files go to tmp."""
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}


def test_a_busy_port_is_refused_before_any_engine_starts(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(serve_command(tiny_model_dir, port), capture_output=True,
                              text=True, timeout=120, env=serve_env(tmp_path / "tmp"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"loragate: error: cannot listen on 127.0.0.1:{port}: Address already in use "
        f"(another server there? pick another --port)"]
    assert "starting" not in done.stdout  # no engine was started
    assert list((tmp_path / "tmp").iterdir()) == []
    # `loragate engine` alike: refused before its model loads (and no "listening" line).
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "gateway.cli", "engine", "--model",
                               str(tiny_model_dir), "--port", str(port)],
                              capture_output=True, text=True, timeout=120,
                              env=serve_env(tmp_path / "tmp"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"loragate: error: cannot listen on 127.0.0.1:{port}: Address already in use "
        f"(another server there? pick another --port)"]


def test_an_unreachable_store_is_refused_before_any_engine_starts(tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    # Redis that does not answer, and a state file another gateway holds: one line each,
    # in a second, not a traceback after the model has loaded.
    closed = free_port()  # nothing listens there
    held = tmp_path / "state.db"
    holder = SqliteStore(str(held))
    try:
        for extra, message in (
                (["--redis-url", f"redis://127.0.0.1:{closed}/0"],
                 f"the state store at redis://127.0.0.1:{closed}/0 is unreachable: "),
                (["--state-path", str(held)],
                 f"the state file {held} is in use by another gateway")):
            done = subprocess.run(serve_command(tiny_model_dir, free_port(), *extra),
                                  capture_output=True, text=True, timeout=120,
                                  env=serve_env(tmp_path / "tmp"))
            assert done.returncode == 2, done.stdout + done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("loragate: error: " + message), lines
            assert "starting" not in done.stdout  # no engine was started
    finally:
        asyncio.run(holder.close())


def test_engine_logs_are_removed_after_a_clean_exit(tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    port = free_port()
    tmp = tmp_path / "tmp"
    process = subprocess.Popen(serve_command(tiny_model_dir, port), env=serve_env(tmp),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:  # through the banner's curl: the gateway is listening
            lines.append(line)
            if line.lstrip().startswith("-d '"):
                break
        # The banner's curl, pasted as printed, gets an answer.
        curl = "".join(lines[next(i for i, x in enumerate(lines) if "curl " in x):])
        pasted = subprocess.run(["bash", "-c", curl], capture_output=True, text=True,
                                timeout=120)
        assert pasted.returncode == 0 and '"chat.completion"' in pasted.stdout, (curl, pasted)
        assert [p.name[:17] for p in tmp.iterdir()] == ["loragate-engines-"]
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = "".join(lines) + rest
    assert process.returncode == 0, output
    assert re.search(r"engine http://127\.0\.0\.1:\d+ ready after \d+s", output), output
    assert "stopping 1 engine instance(s)" in output
    assert list(tmp.iterdir()) == [], output


def children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_engines_do_not_outlive_a_gateway_killed_outright(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(serve_command(tiny_model_dir, port),
                               env=serve_env(tmp_path / "tmp"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    engines: list[int] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("loragate gateway listening on"):
                break
        engines += children_of(process.pid)
        assert len(engines) == 1
        process.kill()  # as the OOM killer would: no handler runs, no child is told
        process.wait()
        deadline = time.monotonic() + 60
        while alive(engines[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(engines[0]), "the engine outlived its gateway"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in filter(alive, engines):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_engines_started_together_split_the_cores(tiny_model_dir: Path,
                                                  tmp_path: Path) -> None:
    port = free_port()
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    tmp = tmp_path / "tmp"
    process = subprocess.Popen(serve_command(tiny_model_dir, port, "--instances", "2",
                                             "--drain-timeout-s", "3"),
                               env=serve_env(tmp), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith("loragate gateway listening on"):
                break
        engines = children_of(process.pid)
        assert len(engines) == 2, lines
        for pid in engines:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"OMP_NUM_THREADS={share}".encode() in environ
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert command[command.index(b"--cpu-threads") + 1] == str(share).encode()
            # They drain no longer than the gateway does.
            assert command[command.index(b"--drain-timeout-s") + 1] == b"3.0"
        process.send_signal(signal.SIGTERM)
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith("stopping 2 engine instance(s)"):
                process.send_signal(signal.SIGTERM)  # during the cleanup: changes nothing
                break
        lines.append(process.communicate(timeout=120)[0])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert f"{share} CPU thread(s) each" in "".join(lines)
    assert process.returncode == 0, "".join(lines)
    assert list(tmp.iterdir()) == [], "".join(lines)  # engines exited cleanly: no logs kept


def test_a_stop_while_engines_load_cleans_up(tiny_model_dir: Path, tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    process = subprocess.Popen(serve_command(tiny_model_dir, free_port(), "--instances", "2"),
                               env=serve_env(tmp), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("starting 2 engine instance(s)"):
                break
        engines = children_of(process.pid)
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output
    assert "SIGTERM: stopped before the gateway listened" in output, output
    assert "Traceback" not in output, output
    survivors = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in engines if alive(pid)]
    assert not survivors, (survivors, output)
    assert list(tmp.iterdir()) == [], output  # no engine log directory left behind


@pytest.fixture
def broken_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with weights that do not load."""
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken, ignore=shutil.ignore_patterns("adapters"))
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    return broken


def test_engine_logs_are_kept_and_shown_when_an_engine_fails(broken_model: Path,
                                                             tmp_path: Path) -> None:
    broken = broken_model
    tmp = tmp_path / "tmp"
    done = subprocess.run(serve_command(broken, free_port()), capture_output=True, text=True,
                          timeout=180, env=serve_env(tmp))
    assert done.returncode == 2, done.stdout + done.stderr
    kept = list(tmp.iterdir())
    assert len(kept) == 1 and (kept[0] / "engine-0.log").is_file()
    assert f"engine logs kept in {kept[0]}" in done.stderr


def test_an_in_process_engine_that_cannot_start_fails_serve_clearly(
        broken_model: Path, tmp_path: Path) -> None:
    command = [c for c in serve_command(broken_model, free_port()) if c != "--engine-process"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180,
                          env=serve_env(tmp_path / "tmp"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("loragate: error: the engine could not start: "), done.stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # no engine log directory left behind


def test_wait_ready_says_which_engines_are_still_loading(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A process that never answers /health: an engine still loading its model.
    loading = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    url = f"http://127.0.0.1:{free_port()}"
    try:
        with pytest.raises(RuntimeError, match="not ready after 1s"):
            wait_ready([EngineProcess(url, loading, tmp_path / "log")], 1.0,
                       progress_every_s=0.2)
    finally:
        loading.kill()
        loading.wait()
    out = capsys.readouterr().out
    assert f"waiting for 1 engine(s) to load the model and warm up (0s): {url}\n" in out
