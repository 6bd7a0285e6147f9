"""A warm launcher for the launch scripts' tests: the training stack imported once per session.

Every torchrun of a launch script spends its first ten seconds or so importing torch,
megatron-core, DeepSpeed and transformers on each rank, which is most of a short test run. This
module's server imports them once; for each run it forks one process per rank and starts them as
torchrun starts its workers: the caller's environment with RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and the TORCHELASTIC_* variables set, stdout and stderr shared by the
ranks, the script run as `__main__` with its folder first on sys.path, and on the first rank that
fails every other one stopped (SIGTERM, then SIGKILL), the run's exit code 1. A rank is a fork of a
process that has started no thread, opened no process group and read no file of the run.

What it does not reproduce is torchrun's own output (its failure summary) and its agent
(restarts, signal forwarding): `support.launch.torchrun(..., warm=False)` runs the real torchrun,
and so does any run whose environment differs from the server's in a variable read at import time.
`INTERLENS_TESTS_COLD=1` sends every run to the real torchrun (and support.dist spawns its
ranks), as a user's runs start.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# imported by the server, in the launch scripts' order (quiet's warning filters first)
PRELOAD = (
    "interlens_mcore.cli.quiet",
    "torch",
    "torch.distributed",
    "megatron.core",
    "deepspeed",
    "transformers",
    "trainers",
    "interlens_mcore.cli.build",
)
# environment variables read when those modules are imported: a run that sets one differently
# from the server's environment cannot share its imports
IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "PYTHON", "TORCH", "HF_", "TRANSFORMERS", "TOKENIZERS", "DS_", "CUDA")
RUN_TIME = ("TORCH_EXTENSIONS_DIR",)  # read when DeepSpeed builds its op, not at import


def differs_at_import(asked: dict[str, str], server: dict[str, str]) -> list[str]:
    """The variables of `asked` (what a run sets on purpose) that are read at import time and that
    the server's environment holds otherwise. Only what the test asks for counts: libraries the
    test process imported set variables of their own (TORCHINDUCTOR_CACHE_DIR), which the ranks
    get as they would from torchrun."""
    return sorted(
        k for k, v in asked.items() if server.get(k) != v and k.startswith(IMPORT_TIME) and k not in RUN_TIME
    )


# ---- the server: one per test session, one run at a time ------------------------------------


def _rank(req: dict, rank: int, port: int) -> None:
    """In the forked child: become rank `rank` of the run and never return."""
    code = 1
    try:
        os.setsid()  # as torchrun's workers: a session of their own, so a stop reaches their children
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(out, fd)
            os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        nproc = req["nproc"]
        os.environ.clear()
        os.environ.update(req["env"])
        if req["torchrun"]:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                ROLE_RANK=str(rank),
                ROLE_NAME="default",
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                ROLE_WORLD_SIZE=str(nproc),
                GROUP_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID=f"warm-{port}",
                TORCHELASTIC_USE_AGENT_STORE="False",
            )
        os.chdir(req["cwd"])
        script = req["script"]
        sys.argv = [script, *req["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _stop(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM each rank's session, then SIGKILL what is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _serve_one(req: dict) -> dict:
    from support.dist import free_port

    if threading.active_count() != 1:  # forking a process with threads can copy a held lock
        return {"refused": f"the server has {threading.active_count()} threads"}
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(req, rank, port)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + req["timeout"]
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if any(c != 0 for c in codes.values()) and len(codes) < len(pids):
            _stop([p for p in pids if p not in codes])  # as torchrun: the first failure ends the run
        elif time.monotonic() > deadline:
            timed_out = True
            _stop(pids, grace=0.0)
        else:
            time.sleep(0.02)
    # the ranks' sessions are gone with them; anything they started in a session of its own
    # (torchrun's workers do the same) is theirs to end
    ranks = [codes[p] for p in pids]
    if not req["torchrun"]:  # `python script.py`: its own exit code
        return {"ranks": ranks, "timed_out": timed_out, "returncode": ranks[0]}
    return {"ranks": ranks, "timed_out": timed_out, "returncode": 0 if all(c == 0 for c in ranks) else 1}


def serve() -> None:
    """Read one JSON request a line on stdin, answer one JSON line on stdout, until stdin closes."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:  # an environment without it (the vLLM stage's has no DeepSpeed ops)
            pass
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_serve_one(json.loads(line))), flush=True)


# ---- the client ------------------------------------------------------------------------------


class WarmLauncher:
    """The test process's handle on its server, started on first use."""

    def __init__(self, environ: dict[str, str], cwd: Path):
        self.environ = environ
        server = [sys.executable, "-c", "from support.warm import serve; serve()"]
        env = dict(environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
        )
        self.proc = subprocess.Popen(
            server, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError("the warm launcher's server did not start (see stderr above)")

    def run(
        self,
        script: Path,
        args: list[str],
        nproc: int,
        env: dict[str, str],
        cwd: Path,
        timeout: float,
        torchrun: bool = True,
    ) -> subprocess.CompletedProcess | None:
        """Run `script` on `nproc` ranks as torchrun would, or (`torchrun=False`) once as
        `python script` would; a CompletedProcess like theirs, or None if the server refused."""
        assert self.proc.stdout is not None and self.proc.stdin is not None
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            req = dict(
                script=str(script), args=list(args), nproc=nproc, env=env, cwd=str(cwd), torchrun=torchrun
            )
            req.update(timeout=timeout, stdout=str(out), stderr=str(err))
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the warm launcher's server died")
            result = json.loads(line)
            if "refused" in result:
                return None
            stdout = out.read_text() if out.exists() else ""
            stderr = err.read_text() if err.exists() else ""
        cmd = ["torchrun(warm)", f"--nproc_per_node={nproc}", str(script), *args] if torchrun else []
        cmd = cmd or ["python(warm)", str(script), *args]
        if result["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, result["returncode"], stdout, stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
