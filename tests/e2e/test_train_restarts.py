"""Runs that stop and go on: extended, resumed at another TP size, failing on one rank, killed
and restarted by torchrun, the same on two "nodes" (launch/multinode.sh), and a library run that
finds its folder taken."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from support.dist import run_ranks
from support.launch import ROOT, SMALL, TRAIN, env, metrics, nodes, torchrun

# an environment that raises on rank 1 at step 1, or (FAULT=kill) kills its process there on the
# first attempt only; otherwise guess-a-number. Conversation ids are "s<step>-r<rank>-..."
FAULTY = """
import os
import signal

from interlens_mcore.tasks.guess import GuessNumber
from interlens_mcore.tasks import GuessTasks


class Faulty(GuessNumber):
    def respond(self, conv):
        step, rank = conv.id.split("-")[:2]
        if step == "s3" and rank == "r1":
            if os.environ.get("FAULT") == "kill" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            if os.environ.get("FAULT") == "raise":
                raise ValueError("the environment broke")
        return super().respond(conv)


class Task:
    def __init__(self, task):
        self.task, self.max_turns = task, task.max_turns

    def prompt(self):
        return self.task.prompt()

    def lineup(self, seat):
        return [seat("policy"), Faulty(self.task)]


class FaultyTasks(GuessTasks):
    name = "faulty"

    def rows(self, n, *, seed):
        return [Task(t) for t in super().rows(n, seed=seed)]


def make():
    return FaultyTasks()
"""


def test_a_failure_on_one_rank_is_every_ranks_last_line(tmp_path):
    (tmp_path / "faulty.py").write_text(FAULTY)
    out = tmp_path / "run"
    start = time.monotonic()
    # fail fast: one sample's error ends the run (by default it would end only the sample)
    args = ["--task", "faulty:make", "--output-dir", str(out), "--steps", "5", *SMALL]
    args += ["--on-sample-error", "raise"]
    res = torchrun(*args, cwd=tmp_path, FAULT="raise")
    elapsed = time.monotonic() - start
    assert res.returncode != 0
    # rank 0 and rank 1 both name it (rank 1's rollout vote wraps the environment's error)
    said = res.stderr.split("train_grpo.py: error: rank 1 failed: ")[1:]
    assert len(said) == 2 and all("ValueError: the environment broke" in s.splitlines()[0] for s in said)
    assert "Connection closed by peer" not in res.stderr
    assert elapsed < 120
    assert [r["step"] for r in metrics(out)] == [0, 1, 2]  # what was done before is kept


FAULTY_RUN = ["--task", "faulty:make", "--steps", "6", *SMALL]  # SMALL saves every 2 steps


@pytest.fixture(scope="module")
def clean_faulty_run(tmp_path_factory):
    """The faulty task's run with no fault: what a restarted run must reach."""
    tmp = tmp_path_factory.mktemp("clean")
    (tmp / "faulty.py").write_text(FAULTY)
    res = torchrun(*FAULTY_RUN, "--output-dir", str(tmp / "run"), cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    return metrics(tmp / "run")


@pytest.mark.slow  # the real torchrun agent restarting workers: the slow stage
def test_killed_worker_restarts_and_reaches_the_same_metrics(tmp_path, clean_faulty_run):
    (tmp_path / "faulty.py").write_text(FAULTY)
    killed = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
    ]
    cmd += [str(TRAIN), *FAULTY_RUN, "--output-dir", str(killed), "--resume", "auto"]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env(FAULT="kill")
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming at step 2 of 6" in res.stderr  # the restart continued from the checkpoint
    done = metrics(killed)
    assert [r["step"] for r in done] == list(range(6))
    assert [r["reward_mean"] for r in done] == [r["reward_mean"] for r in clean_faulty_run]


@pytest.mark.slow  # the real torchrun agent restarting workers: the slow stage
def test_two_nodes_run_the_job_and_restart_a_lost_nodes_worker(tmp_path, clean_faulty_run):
    # launch/multinode.sh once a "node", one worker each, a c10d rendezvous: the vote and the
    # world checks go across nodes; the worker of the node holding rank 1 is killed at step 3 on
    # the first attempt, both agents restart their workers, and the run resumes from step 2
    (tmp_path / "faulty.py").write_text(FAULTY)
    out = tmp_path / "run"
    done = nodes(
        *FAULTY_RUN, "--output-dir", str(out), cwd=tmp_path, timeout=400, FAULT="kill", MAX_RESTARTS="1"
    )
    for res in done:
        assert res.returncode == 0, res.stderr[-3000:]
    said = "".join(res.stderr for res in done)
    assert said.count("resuming at step 2 of 6") >= 1
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(6))
    assert [r["reward_mean"] for r in records] == [r["reward_mean"] for r in clean_faulty_run]


@pytest.mark.slow  # the real torchrun agent restarting workers: the slow stage
def test_a_failure_on_another_node_is_every_ranks_last_line(tmp_path):
    (tmp_path / "faulty.py").write_text(FAULTY)
    args = ["--task", "faulty:make", "--output-dir", str(tmp_path / "run"), "--steps", "5", *SMALL]
    done = nodes(*args, "--on-sample-error", "raise", cwd=tmp_path, FAULT="raise", MAX_RESTARTS="0")
    assert all(res.returncode != 0 for res in done)
    for res in done:  # each node's worker names rank 1's error
        assert "train_grpo.py: error: rank 1 failed: " in res.stderr, res.stderr[-3000:]
        assert "ValueError: the environment broke" in res.stderr


def _library_run_twice(rank, world_size, tiny_path, out):
    from transformers import AutoTokenizer

    from interlens_mcore import distributed
    from interlens_mcore.grpo.loss.config import LossConfig
    from interlens_mcore.rollout.rollouter import RolloutConfig
    from interlens_mcore.tasks import GuessTasks
    from trainers import GRPOTrainer, MegatronBackend, TrainerConfig
    from trainers.rundir import RunDirError

    distributed.init_megatron(1)
    groups = distributed.build_groups(rollout="model_parallel")

    def trainer(steps):
        return GRPOTrainer(
            backend=MegatronBackend(model_path=tiny_path, groups=groups, lr=1e-3),
            tasks=GuessTasks(),
            groups=groups,
            tokenizer=AutoTokenizer.from_pretrained(tiny_path),
            config=TrainerConfig(steps=steps, batch_size=4, output_dir=out, eval_every=0, save_every=2),
            rollout_config=RolloutConfig(num_generations=2, max_new_tokens=3),
            loss_config=LossConfig(beta=0.0),
        )

    trainer(2).train()
    lines = (ROOT / out / "metrics.jsonl").read_text().count("\n")
    try:
        trainer(2).train()
        refused = None
    except RunDirError as exc:
        refused = str(exc)
    kept = (ROOT / out / "metrics.jsonl").read_text().count("\n")
    again = trainer(4)
    again.resume()
    records = again.train()
    return lines, refused, kept, [r["step"] for r in records]


def test_a_library_run_guards_its_folder_as_the_command_line_does(tmp_path, tiny_path):
    [(lines, refused, kept, steps)] = run_ranks(_library_run_twice, 1, str(tiny_path), str(tmp_path / "lib"))
    assert lines == 2 and kept == 2  # nothing already written was truncated
    assert refused is not None and "holds another run; pass --resume" in refused
    assert steps == [2, 3]  # resume() then train() extends it to the new step count
