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

The helper is one process, started on the first structured request (``spawn``: a fresh
interpreter with xgrammar and the tokenizer's vocabulary only, about a second), serving one
spec at a time. It ends with the engine (a daemon process; a helper whose parent died reads
EOF and exits).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
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
        self._process: Any = None
        self._conn: Connection | None = None
        self._broken = False
        """The helper could not be started: specs compile unbounded (logged once)."""

    def check(self, kind: str, text: str, any_whitespace: bool, param: str) -> None:
        """Return once the helper compiled ``text`` (as ``kind``) within the timeout, or
        failed to (the caller's own compile then reports the spec's error); InvalidField
        naming ``param`` when it took longer."""
        with self._lock:
            conn = self._helper()
            if conn is None:
                return
            started = time.monotonic()
            try:
                conn.send((kind, text, any_whitespace))
                if conn.poll(self.timeout_s):
                    conn.recv()
                    return
            except (OSError, EOFError):  # the helper died (killed from outside): no bound
                self._stop()             # this time; the next spec starts a new one
                return
            self._stop()
        log.warning("a %s spec took longer than %.1f s to compile; refused and the grammar "
                    "helper restarted", kind, time.monotonic() - started)
        raise InvalidField(param, f"the {kind} spec takes longer than {self.timeout_s:g} s to "
                                  f"compile (grammar_compile_timeout_s): simplify it (fewer "
                                  f"or smaller repetitions, less nesting)")

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _helper(self) -> Connection | None:
        if self._conn is not None or self._broken:
            return self._conn
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, self._info),
                                  name="loragate-grammar-probe", daemon=True)
        try:
            process.start()
            child.close()
            if not parent.poll(START_TIMEOUT_S) or parent.recv() != "ready":
                raise OSError("the grammar helper did not start")
        except (OSError, EOFError) as exc:
            log.warning("grammar compiles are not time-bounded: %s", exc)
            process.kill()
            self._broken = True
            return None
        self._process, self._conn = process, parent
        return parent

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


def _serve(conn: Connection, tokenizer_info_json: str) -> None:
    """The helper: compile each spec it is sent, answer when done (its result or error is of
    no use to the engine, only the time it took)."""
    import xgrammar

    compiler = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1,
        cache_enabled=False)
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
