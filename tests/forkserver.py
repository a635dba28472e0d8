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
threaded process is unsafe): it polls its stdin, its socket and its children.

The example recipes (shell scripts that start a dozen tools each) reach the
same server through :func:`write_shims`: a folder of small executables named
like the tools (and ``python``), each of which connects to the server's Unix
socket, hands over its standard streams (``SCM_RIGHTS``) with its argv,
environment and directory (and which of SIGINT and SIGTERM it found ignored:
the run starts with the dispositions a fresh interpreter would have had),
forwards SIGINT/SIGTERM to the run, and exits with the run's status.  A
recipe given that folder as its ``VENV_BIN`` runs as before, its tools
forked instead of started.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Dict, List, Optional

ROUTED_PREFIXES = ("alibi-", "fairseq-")


def _start_with_signals(ignored: List[int]) -> None:
    """SIGINT and SIGTERM as a fresh interpreter exec'd by the shim's parent
    would have them: ignored where the shim found them ignored, else SIGINT
    raising KeyboardInterrupt and SIGTERM's default.  A fork inherits the
    server's instead (the test worker's: ignored when the suite was started in
    the background of a shell), and a recipe that restored Ctrl-C for its
    tools would then see them ignore it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN if signal.SIGINT in ignored else signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if signal.SIGTERM in ignored else signal.SIG_DFL)


def _run_child(request: dict, fds: Optional[List[int]] = None) -> int:
    """In the forked child: become the requested command, run it, return its exit status.
    ``fds``: the standard streams handed over by a shim, else the request's files."""
    import atexit
    import runpy
    import traceback

    if fds is None:
        fds = [os.open(request["stdin"], os.O_RDONLY),
               os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
               os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)]
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if "ignored" in request:  # a shim's run: the signal dispositions its tool would have started with
        _start_with_signals(request["ignored"])
    # torch read OMP_NUM_THREADS when the server imported it: a run's own value (the recipes give
    # each training and evaluation one thread) applies as it would in a fresh interpreter. Left at
    # the server's count, a run's threads oversubscribe the cores the others use, and every
    # parallel region waits for them (an evaluation of toy models took minutes instead of seconds).
    threads = request["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
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
    """The server's loop: fork a child per request (a line on stdin, or a shim's
    connection on the socket named by ``FORKSERVER_SOCKET``), report starts and ends."""
    from fairseq_alibi import patches

    patches.deferred_metric_imports()  # torch and fairseq, as a console script imports them
    for name in [m for m in sys.modules if m.split(".")[0] == "fairseq_alibi"]:
        del sys.modules[name]  # each run imports the plugin itself (fairseq's --user-dir skips a known name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.environ["FORKSERVER_SOCKET"])
    listener.listen(64)
    children: Dict[int, object] = {}  # pid -> request id (stdin's requests) or the shim's connection
    pending = b""
    stdin_open = True
    while stdin_open or children:
        ready = select.select([0, listener] if stdin_open else [listener], [], [], 0.02)[0]
        if 0 in ready:
            chunk = os.read(0, 65536)
            stdin_open = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = _fork(request, None)
                children[pid] = request["id"]
                _reply({"id": request["id"], "pid": pid})
        if listener in ready:
            connection, _ = listener.accept()
            request, fds = _receive(connection)
            pid = _fork(request, fds)
            for fd in fds:
                os.close(fd)
            connection.sendall((json.dumps({"pid": pid}) + "\n").encode())
            children[pid] = connection
        while children:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            owner, status = children.pop(pid), os.waitstatus_to_exitcode(wait_status)
            if isinstance(owner, socket.socket):
                try:
                    owner.sendall((json.dumps({"status": status}) + "\n").encode())
                except OSError:  # the shim is gone (killed): nobody to tell
                    pass
                owner.close()
            else:
                _reply({"id": owner, "status": status})


def _fork(request: dict, fds: Optional[List[int]]) -> int:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = _run_child(request, fds)
        finally:
            os._exit(status)
    return pid


def _receive(connection: socket.socket):
    """A shim's request (one JSON line) and the standard streams it sent along."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    while not data.endswith(b"\n"):
        chunk = connection.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    return json.loads(data), list(fds)


SHIM = """#!{python} -IS
# A stand-in for {real}: runs it as a fork of the test worker's fork server (tests/forkserver.py).
import json, os, signal, socket, sys
real, args = {real!r}, sys.argv[1:]
if {is_python!r} and not (args and (args[0] in ("-c", "-m") or args[0].endswith(".py"))):
    os.execv(real, [real] + args)  # what the server cannot run as the interpreter would
pid, early = None, []  # a signal that comes before the run's pid is passed on once it is known
def forward(sent, frame):
    early.append(sent) if pid is None else os.kill(pid, sent)
ignored = [number for number in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(number) == signal.SIG_IGN]
for number in (signal.SIGINT, signal.SIGTERM):
    signal.signal(number, forward)
connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
connection.connect({socket!r})
request = json.dumps(dict(argv=[real] + args, env=dict(os.environ), cwd=os.getcwd(), ignored=ignored)) + "\\n"
socket.send_fds(connection, [request.encode()], [0, 1, 2])
replies = connection.makefile()
pid = json.loads(replies.readline())["pid"]
for sent in early:
    os.kill(pid, sent)
line = replies.readline()
status = json.loads(line)["status"] if line else 1
sys.exit(status if status >= 0 else 128 - status)
"""


def write_shims(folder: str, bin_dir: str, socket_path: str) -> str:
    """``folder`` filled with a shim per console script of ``bin_dir`` that the
    server runs (``alibi-*``, ``fairseq-*``) and for ``python``; every other entry
    of ``bin_dir`` linked as it is.  Returns ``folder``."""
    os.makedirs(folder, exist_ok=True)
    for name in sorted(os.listdir(bin_dir)):
        real, shim = os.path.join(bin_dir, name), os.path.join(folder, name)
        if os.path.lexists(shim):
            continue
        is_python = os.path.realpath(real) == os.path.realpath(sys.executable)
        if name.startswith(ROUTED_PREFIXES) or is_python:
            with open(shim, "w") as handle:
                handle.write(SHIM.format(python=sys.executable, real=sys.executable if is_python else real,
                                         is_python=is_python, socket=socket_path))
            os.chmod(shim, 0o755)
        else:
            os.symlink(real, shim)
    return folder


def _reply(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


class ForkServer:
    """The client: one server process per test worker; ``run`` is ``subprocess.run``'s subset."""

    def __init__(self, env: dict, socket_path: str):
        self.socket_path = socket_path
        self.process = subprocess.Popen([sys.executable, "-c", "import forkserver; forkserver.serve()"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=dict(env, FORKSERVER_SOCKET=socket_path),
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
