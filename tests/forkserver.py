"""Run the console scripts as forks of one process that has imported torch and fairseq.

Each test that runs a command-line tool used to start a fresh Python, which
spends ~2.3 s importing torch and fairseq before the tool does anything; about
150 such runs made that the largest cost of the suite.  A fork server imports
them once per test worker; every run is then a fork of it that sets its argv,
environment, working directory and standard streams and calls the console
script's entry point (``alibi-*``, ``fairseq-*``) or runs ``python -c`` / a
script / ``-m``, as a fresh interpreter would.  Each run is still its own
process: its exit status, its atexit handlers, its global state die with it.

Only the imports are shared, so the server imports nothing of the plugin
itself (``fairseq_alibi.models`` applies the patches, reads environment
variables and registers models, all of which the run must do itself, and
``--user-dir`` skips a module already imported); it imports fairseq through
``patches.deferred_metric_imports`` as every console script does, then forgets
the plugin's modules.  ``FAIRSEQ_ALIBI_TEST_FORKS=0`` starts real processes instead.

Protocol: one JSON request per line on the server's stdin (id, argv, env,
cwd, and the paths of the run's stdin/stdout/stderr files); one JSON line
``{"id", "pid"}`` when the run has started and ``{"id", "status"}`` when it has
ended, on the server's stdout.  The server is single-threaded (forking a
threaded process is unsafe): it polls its stdin and its children.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from typing import Dict, List, Optional

ROUTED_PREFIXES = ("alibi-", "fairseq-")


def _run_child(request: dict) -> int:
    """In the forked child: become the requested command, run it, return its exit status."""
    import atexit
    import runpy
    import traceback

    fd_in = os.open(request["stdin"], os.O_RDONLY)
    fd_out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fd_err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv: List[str] = request["argv"]
    code = 0
    try:
        if os.path.basename(argv[0]).startswith(ROUTED_PREFIXES):
            from importlib.metadata import entry_points

            (entry,) = [e for e in entry_points(group="console_scripts") if e.name == os.path.basename(argv[0])]
            if entry.name == "fairseq-train":  # configures logging before importing fairseq (the others after)
                import logging

                for handler in logging.root.handlers[:]:
                    logging.root.removeHandler(handler)
                logging.root.setLevel(logging.WARNING)
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(argv[0])
            code = entry.load()()
        elif argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            sys.path[0] = ""
            exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv[1:])
            sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # an uncaught exception: what the interpreter prints, status 1
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def serve() -> None:
    """The server's loop: fork a child per request line, report starts and ends."""
    from fairseq_alibi import patches

    patches.deferred_metric_imports()  # torch and fairseq, as a console script imports them
    for name in [m for m in sys.modules if m.split(".")[0] == "fairseq_alibi"]:
        del sys.modules[name]  # each run imports the plugin itself (fairseq's --user-dir skips a known name)
    children: Dict[int, int] = {}  # pid -> request id
    pending = b""
    stdin_open = True
    while stdin_open or children:
        ready = select.select([0], [], [], 0.02)[0] if stdin_open else []
        if ready:
            chunk = os.read(0, 65536)
            stdin_open = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    status = 1
                    try:
                        status = _run_child(request)
                    finally:
                        os._exit(status)
                children[pid] = request["id"]
                _reply({"id": request["id"], "pid": pid})
        while children:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _reply({"id": children.pop(pid), "status": os.waitstatus_to_exitcode(wait_status)})


def _reply(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


class ForkServer:
    """The client: one server process per test worker; ``run`` is ``subprocess.run``'s subset."""

    def __init__(self, env: dict):
        self.process = subprocess.Popen([sys.executable, "-c", "import forkserver; forkserver.serve()"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                        cwd=os.path.dirname(os.path.abspath(__file__)))
        self.lock = threading.Lock()
        self.closed = False
        self.next_id = 0
        self.events: Dict[int, dict] = {}
        self.arrived = threading.Condition(self.lock)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self.lock:
                self.events.setdefault(message["id"], {}).update(message)
                self.arrived.notify_all()
        with self.lock:
            self.events = {i: dict(e, status=e.get("status", -9)) for i, e in self.events.items()}
            self.closed = True
            self.arrived.notify_all()

    def run(self, argv: List[str], env: dict, cwd: Optional[str], stdin: Optional[str], timeout: float,
            scratch: str) -> subprocess.CompletedProcess:
        with self.lock:
            request_id, self.next_id = self.next_id, self.next_id + 1
        paths = {name: os.path.join(scratch, f"run{request_id}.{name}") for name in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "w") as f:
            f.write(stdin or "")
        request = dict(id=request_id, argv=argv, env=env, cwd=os.path.abspath(cwd or os.getcwd()), **paths)
        with self.lock:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            ended = self.arrived.wait_for(lambda: "status" in self.events.get(request_id, {}), timeout)
            event = self.events.pop(request_id, {}) if ended else self.events.get(request_id, {})
        if not ended:
            if "pid" in event:
                os.kill(event["pid"], 9)
            raise subprocess.TimeoutExpired(argv, timeout)
        outputs = {}
        for name in ("stdout", "stderr"):
            with open(paths[name], errors="replace") as f:
                outputs[name] = f.read()
        for path in paths.values():
            os.unlink(path)
        return subprocess.CompletedProcess(argv, event["status"], outputs["stdout"], outputs["stderr"])

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        except Exception:
            self.process.kill()


def routed(argv: List[str]) -> bool:
    """What the server can run: our and fairseq's console scripts, ``python -c|-m|script``."""
    name = os.path.basename(argv[0])
    if name.startswith(ROUTED_PREFIXES):
        return True
    return argv[0] == sys.executable and len(argv) > 1 and (argv[1] in ("-c", "-m") or argv[1].endswith(".py"))
