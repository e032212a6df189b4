"""A time bound on compiling a structured-output grammar.

xgrammar's compile cannot be interrupted, and its cost is not told by a spec's size: a
30-character JSON schema (a string ``pattern`` of ``[a-z]{1,20000}``) took 50 s on one core, a
schema nested 900 deep 40 s. Compiled in the engine's process, such a spec would hold the
preparing thread (and every other tenant's new grammar behind it) for as long as it takes.

So a new spec is compiled first in a helper process, which is killed when it takes longer
than the timeout: the request is refused (400 naming its field) and the helper started
again for the next one. A spec the helper compiled in time is then compiled in the engine's
process, which takes about as long (the compiled grammar cannot be handed over: xgrammar's
serialized form of a large grammar is bigger than the grammar by orders of magnitude). Only
specs not in the compiled cache pay this twice; RAG and tool traffic repeats its schemas.

The helper is one process, started on the first structured request: a fresh interpreter
(``python -m engine.grammar_probe``, not multiprocessing's spawn, which would run the
caller's main script again) with xgrammar and the tokenizer's vocabulary only: about two
seconds to start, once per engine, and ~290 MB resident, most of it torch's shared
libraries (xgrammar imports torch); it serves one spec at a time over a socket pair. It is
killed when the engine closes, ignores the terminal's Ctrl-C (the engine's drain decides
when it goes), and one whose engine died reads EOF and exits.

A spec thus holds its caller (and the preparing thread) for at most about twice the bound:
the helper's try, then the engine's own compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.invalid_field import InvalidField

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0
"""How long the helper may take to start (import xgrammar, read the vocabulary)."""


class GrammarProbe:
    """Times a spec's compile in the helper process (thread-safe: one spec at a time)."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float) -> None:
        self._info = tokenizer_info_json
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._broken = False
        """The helper could not be started, or the probe was closed: specs compile
        unbounded."""

    def check(self, kind: str, text: str, any_whitespace: bool, param: str) -> None:
        """Return once the helper compiled ``text`` (as ``kind``) within the timeout, or
        failed to (the caller's own compile then reports the spec's error); InvalidField
        naming ``param`` when it took longer, or when the helper died compiling it (it ran
        out of memory, say: the spec is no safer in the engine's process)."""
        with self._lock:
            for _ in range(2):
                conn = self._helper()
                if conn is None:
                    return  # no helper could start: unbounded (logged once)
                try:
                    conn.send((kind, text, any_whitespace))
                except OSError:  # the helper was gone before this spec: start another
                    self._stop()
                    continue
                started = time.monotonic()
                died = False
                if conn.poll(self.timeout_s):
                    try:
                        conn.recv()
                        return
                    except (OSError, EOFError):
                        died = True
                waited = time.monotonic() - started
                self._stop()
                break
            else:
                return  # two helpers in a row gone before a spec: unbounded this time
        log.warning("a %s spec %s after %.1f s; refused and the grammar helper restarted",
                    kind, "ended the compile helper" if died else "was still compiling", waited)
        reason = "ended the compile helper (out of memory?)" if died else \
            f"takes longer than {self.timeout_s:g} s to compile (grammar_compile_timeout_s)"
        raise InvalidField(param, f"the {kind} spec {reason}: simplify it (fewer or smaller "
                                  f"repetitions, less nesting)")

    def close(self) -> None:
        """Stop the helper for good (the engine is closing: a later spec is not bounded)."""
        with self._lock:
            self._broken = True
            self._stop()

    def _helper(self) -> Connection | None:
        if self._conn is not None or self._broken:
            return self._conn
        ours, theirs = socket.socketpair()
        # The package's root on the helper's path: an engine run from a checkout, not an
        # install, must find it too.
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, (root, os.environ.get("PYTHONPATH"))))}
        process = None
        conn = Connection(ours.detach())
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "engine.grammar_probe", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
            theirs.close()
            conn.send(self._info)
            if not conn.poll(START_TIMEOUT_S) or conn.recv() != "ready":
                raise OSError("the grammar helper did not start")
        except (OSError, EOFError) as exc:
            log.warning("grammar compiles are not time-bounded: %s", exc)
            theirs.close()
            conn.close()
            if process is not None:
                process.kill()
                process.wait(5)
            self._broken = True
            return None
        self._process, self._conn = process, conn
        return conn

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


def _serve(conn: Connection) -> None:
    """The helper: read the tokenizer's vocabulary, then compile each spec it is sent and
    answer when done (its result or error is of no use to the engine, only the time it
    took)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the group
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            kind, text, any_whitespace = conn.recv()
        except (EOFError, OSError):
            return  # the engine is gone
        with contextlib.suppress(Exception):  # a bad spec: the engine's own compile says so
            compile_spec(compiler, kind, text, any_whitespace)
        conn.send("done")


def compile_spec(compiler: Any, kind: str, text: str, any_whitespace: bool) -> Any:
    """xgrammar's compile of one spec: ``text`` is the JSON schema ("json", "json_object"),
    the regex, the structural tag, or the EBNF grammar (a choice's grammar included)."""
    if kind in ("json", "json_object"):
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(text)
    return compiler.compile_grammar(text)


if __name__ == "__main__":  # the helper process: python -m engine.grammar_probe FD
    _serve(Connection(int(sys.argv[1])))
