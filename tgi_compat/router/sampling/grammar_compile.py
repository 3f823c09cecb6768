"""Grammar compiles in a child process, the one way to stop a compile (tgi_compat/router/sampling/grammar.py uses it).

An xgrammar compile cannot be interrupted, and its cost does not follow the spec's size: on the 2-core
development machine a 36 KB schema of 300 `anyOf` properties took 5.7 s and 60 MB, a 700 KB enum 12 s and
170 MB. Run in an engine thread, a compile went on after its client left, and its memory stayed with the
engine. Here one child compiles one grammar at a time, at a lower priority than the serving processes, and
is killed when the compile passes `--grammar-compile-timeout` or when no request waits for it any more: the
cores are free at once, and the child's memory goes with it (the next compile starts a new one). A grammar
compiled larger than an eighth of `--grammar-cache-bytes` is refused in the child; the others reach the engine
serialized (xgrammar's JSON), to be read back against the same tokenizer. Reading one back takes about
ten times its size for a moment, which is why one grammar may take an eighth of the cache at most, and
why the engine gives the freed memory back to the system afterwards (return_freed_memory).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from tgi_compat.router.process_exit import exit_with_parent, name_process
from tgi_compat.router.request import GrammarKind, GrammarSpec
from tgi_compat.router.sampling.grammar_ebnf import fold_bounded_repetitions

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # xgrammar's threads for one compile
CHILD_NICENESS = 10  # a compile takes the cycles the engine and the API leave
STARTUP_TIMEOUT_S = 300.0  # importing xgrammar (and torch) in a fresh child
_CPP_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[12:00:00] /project/cpp/x.cc:83: " prefix


class GrammarCompileError(ValueError):
    """The spec does not compile, or passes a limit; the message is what the client sees after TGI's prefix."""


class CompileCancelled(Exception):
    """The compile was stopped because no request waits for it any more."""


@dataclass(frozen=True, slots=True)
class CompileLimits:
    timeout_s: float  # --grammar-compile-timeout
    cache_bytes: int  # --grammar-cache-bytes: compiled grammars the engine keeps

    @property
    def max_grammar_bytes(self) -> int:
        """The most one compiled grammar may take: reading it back in the engine takes about ten times its
        size for a moment (xgrammar's JSON), and the cache should hold several."""
        return self.cache_bytes // 8


def compile_error_message(spec: GrammarSpec, detail: str) -> str:
    """TGI's texts: an invalid regex, or a schema that cannot be turned into a regex."""
    if spec.kind is GrammarKind.REGEX:
        return f"grammar is not valid: {detail}"
    return f"cannot compile regex from schema: {detail}"


class CompileProcess:
    """The child and its pipe. compile() runs in one thread (the backend's compile thread); cancel() comes
    from the engine loop and stops the compile it names, if that one is running. A child that is stopped
    is replaced at once, so the next compile finds it (nearly) ready: a start takes seconds (torch)."""

    def __init__(self, tokenizer_info: str, limits: CompileLimits) -> None:
        self._tokenizer_info = tokenizer_info  # xgrammar.TokenizerInfo.serialize_json()
        self.limits = limits
        self._lock = threading.Lock()  # the child and the running spec, shared with cancel()
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None
        self._started = 0.0  # perf_counter() at the child's start; 0.0 once it said it is ready
        self._running: GrammarSpec | None = None
        self._cancelled = False
        self._shut_down = False

    def compile(self, spec: GrammarSpec) -> str:
        """The compiled grammar of `spec`, serialized; GrammarCompileError, or CompileCancelled."""
        connection = self._ready_connection()
        with self._lock:
            self._running, self._cancelled = spec, False
        crashed = False
        try:
            connection.send((spec.kind.value, spec.value, spec.strict))
            answer = connection.recv() if connection.poll(self.limits.timeout_s) else None
        except (EOFError, OSError):  # the child is gone: killed by cancel(), or it crashed
            answer, crashed = None, True
        with self._lock:
            self._running, cancelled = None, self._cancelled
        if answer is None or cancelled:
            exit_code = self._restart()
        if cancelled:  # (an answer that raced the kill is dropped too: nobody waits for it)
            raise CompileCancelled
        if crashed:
            raise GrammarCompileError(compile_error_message(spec, f"the grammar compiler exited ({exit_code})"))
        if answer is None:
            detail = f"compiling it took longer than {self.limits.timeout_s:g} s (--grammar-compile-timeout)"
            raise GrammarCompileError(compile_error_message(spec, detail))
        compiled, payload = answer
        if not compiled:
            raise GrammarCompileError(payload)
        return payload

    def cancel(self, spec: GrammarSpec) -> None:
        """Stop the compile of `spec` if it is the one running (compile() then raises CompileCancelled)."""
        with self._lock:
            if self._running == spec and self._process is not None:
                self._cancelled = True
                self._process.kill()  # SIGKILL: the cores are free now; compile() reaps the child

    def shutdown(self) -> None:
        with self._lock:
            self._shut_down = True
            if self._process is not None:
                self._process.kill()

    def _restart(self) -> int | None:
        """Kill the child (if it still runs), wait for it and start another; the old one's exit code."""
        with self._lock:
            process, self._process, self._connection = self._process, None, None
        if process is None:
            return None
        process.kill()
        exit_code = process.wait()
        if not self._shut_down:
            self._start()
        return exit_code

    def _start(self) -> None:
        """A fresh interpreter on this module (not multiprocessing's spawn, which would import this process's
        __main__ again) with the pipe as an inherited descriptor; it reads the tokenizer before its imports."""
        parent_end, child_end = multiprocessing.Pipe()
        command = [
            sys.executable,
            "-m",
            __name__,
            str(child_end.fileno()),
            str(os.getpid()),
            str(self.limits.max_grammar_bytes),
        ]
        process = subprocess.Popen(command, pass_fds=[child_end.fileno()])
        child_end.close()
        with self._lock:
            self._process, self._connection, self._started = process, parent_end, time.perf_counter()
        try:
            parent_end.send(self._tokenizer_info)
        except OSError:
            pass  # it died at once: _ready_connection finds out

    def _ready_connection(self) -> Connection:
        """The pipe to a child that has loaded xgrammar and the tokenizer."""
        if self._connection is None:
            self._start()
        assert self._connection is not None and self._process is not None
        if not self._started:
            return self._connection
        try:
            ready = self._connection.poll(STARTUP_TIMEOUT_S) and self._connection.recv()
        except (EOFError, OSError):  # the child died while starting
            ready = False
        if not ready:
            self._restart()
            raise GrammarCompileError(f"the grammar compiler did not start within {STARTUP_TIMEOUT_S:g} s")
        logger.info(
            "grammar compile process %d ready in %.2f s", self._process.pid, time.perf_counter() - self._started
        )
        self._started = 0.0
        return self._connection


def serve_compiles(connection: Connection, parent_pid: int, max_bytes: int) -> None:
    """The child: compile what the pipe brings, one at a time, until the pipe closes."""
    exit_with_parent(parent_pid)
    name_process("grammar-compile")
    os.nice(CHILD_NICENESS)
    try:
        tokenizer_info = connection.recv()  # first: the parent's send waits for it
        import xgrammar

        info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info)
        compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        connection.send(True)  # ready
        while True:
            kind, value, strict = connection.recv()
            connection.send(_compile(compiler, GrammarSpec(GrammarKind(kind), value, strict), max_bytes))
            return_freed_memory()  # the child holds nothing between compiles
    except (EOFError, OSError):  # the engine closed the pipe: it needs this child no more
        return


def _compile(compiler: xgrammar.GrammarCompiler, spec: GrammarSpec, max_bytes: int) -> tuple[bool, str]:
    """(True, the compiled grammar as JSON) or (False, the client's message). xgrammar's own cache is off:
    the engine keeps the compiled grammars (with it on, the 2,000-value enum of the tests compiled in 6 s
    instead of 1 s, and its memory grew past the cache's limit)."""
    try:
        if spec.kind is GrammarKind.ANY_JSON:
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_grammar(grammar_ebnf(spec))
    except (RuntimeError, ValueError, TypeError) as error:
        return False, compile_error_message(spec, _without_cpp_location(str(error)))
    if (size := compiled.memory_size_bytes) > max_bytes:
        detail = (
            f"the compiled grammar takes {size / 2**20:.0f} MiB, more than the {max_bytes / 2**20:.0f} MiB "
            "one grammar may take (an eighth of --grammar-cache-bytes)"
        )
        return False, compile_error_message(spec, detail)
    return True, compiled.serialize_json()


def return_freed_memory() -> None:
    """Give the system the memory malloc keeps for reuse: reading a large grammar back frees millions of
    small blocks (the JSON's parse), hundreds of MiB that would otherwise stay with the engine."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def grammar_ebnf(spec: GrammarSpec) -> str:
    """The EBNF of a regex or JSON-schema spec, as xgrammar converts it, with its bounded repetitions
    folded (tgi_compat/router/sampling/grammar_ebnf.py: the same language, masks that fill fast)."""
    import xgrammar

    if spec.kind is GrammarKind.REGEX:
        grammar = xgrammar.Grammar.from_regex(spec.value)
    else:
        grammar = xgrammar.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=spec.strict)
    return fold_bounded_repetitions(str(grammar))


def _without_cpp_location(message: str) -> str:
    """xgrammar's message without its "[12:00:00] /project/cpp/x.cc:83: " prefix."""
    return _CPP_LOCATION.sub("", message.strip()).strip()


if __name__ == "__main__":  # the child: python -m tgi_compat.router.sampling.grammar_compile FD PARENT_PID MAX_BYTES
    serve_compiles(Connection(int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
