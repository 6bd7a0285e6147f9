"""The tests' warm launcher (tests/support/warm.py) starts ranks as torchrun starts its workers.

Each case runs a small script through the session's launcher: what a rank sees (its environment,
argv, sys.path, `__main__`), how a failing rank ends the run, a run past its deadline, and the
single-process form `support.launch.python` uses.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from support.launch import _warm_launcher, env
from support.warm import differs_at_import

SCRIPT = """
import json, os, sys
print(json.dumps({
    "rank": os.environ.get("RANK"), "world": os.environ.get("WORLD_SIZE"),
    "local": os.environ.get("LOCAL_RANK"), "port": os.environ.get("MASTER_PORT"),
    "asked": os.environ.get("WARM_TEST"), "argv": sys.argv[1:], "cwd": os.getcwd(),
    "path0": sys.path[0], "main": __name__,
}), flush=True)
code = int(os.environ.get("EXIT_" + os.environ.get("RANK", "none"), "0"))
if code < 0:
    import time
    time.sleep(600)
sys.exit(code)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job" / "job.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def _run(script, *args, nproc=2, timeout=60.0, torchrun=True, **extra):
    launcher = _warm_launcher()
    done = launcher.run(
        script, list(args), nproc, env(**extra), script.parent.parent, timeout, torchrun=torchrun
    )
    assert done is not None, "the server refused the run"
    return done


def test_each_rank_sees_what_torchrun_gives_its_workers(script):
    import json

    done = _run(script, "--flag", "x", WARM_TEST="yes")
    assert done.returncode == 0, done.stderr
    seen = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in seen] == ["0", "1"] and {r["world"] for r in seen} == {"2"}
    assert [r["local"] for r in seen] == ["0", "1"]
    assert len({r["port"] for r in seen}) == 1 and seen[0]["port"].isdigit()  # one rendezvous
    for r in seen:
        assert r["asked"] == "yes" and r["argv"] == ["--flag", "x"] and r["main"] == "__main__"
        assert r["cwd"] == str(script.parent.parent) and r["path0"] == str(script.parent)


def test_a_failing_rank_stops_the_others_and_the_run_exits_1(script):
    # rank 1 fails while rank 0 would sleep for ten minutes: the run ends well before its deadline
    done = _run(script, timeout=60.0, EXIT_0="-1", EXIT_1="3")
    assert done.returncode == 1


def test_a_run_past_its_deadline_is_killed_and_the_server_goes_on(script):
    with pytest.raises(subprocess.TimeoutExpired):
        _run(script, timeout=2.0, EXIT_0="-1", EXIT_1="-1")
    assert _run(script).returncode == 0


def test_python_form_keeps_the_exit_code_and_sets_no_rank(script):
    import json

    done = _run(script, nproc=1, torchrun=False, EXIT_none="5")
    assert done.returncode == 5
    assert json.loads(done.stdout)["rank"] is None


def test_only_a_variable_asked_for_and_read_at_import_sends_a_run_cold():
    server = {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/a"}
    assert differs_at_import({"OMP_NUM_THREADS": "1", "PYTHONPATH": "/a"}, server) == []
    assert differs_at_import({"OMP_NUM_THREADS": "2"}, server) == ["OMP_NUM_THREADS"]
    assert differs_at_import({"PYTHONPATH": "/b", "FAULT": "x"}, server) == ["PYTHONPATH"]
    # read when DeepSpeed builds its op, not at import
    assert differs_at_import({"TORCH_EXTENSIONS_DIR": "/tmp/x"}, server) == []
