"""`launch/train_grpo.py --task duel`: two trained seats (self-play) or one against a frozen copy."""

from __future__ import annotations

from support.launch import SMALL, evaluations, metrics, python, torchrun


def test_self_play_logs_each_seat_and_win_rates(tmp_path):
    out = tmp_path / "duel"
    res = torchrun("--output-dir", str(out), "--task", "duel", "--steps", "3", "--eval-every", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    records = metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert 0.0 <= r["reward_mean/player_a"] <= 1.0 and 0.0 <= r["reward_mean/player_b"] <= 1.0
        assert r["timeouts"] == 0
    # evaluations before steps 0 and 2, and of the final weights (step 3); a tie counts half a win
    evals = evaluations(out)
    assert [r["step"] for r in evals] == [0, 2, 3]
    for r in evals:
        for seat in ("player_a", "player_b"):
            rate = r[f"eval/win_rate/{seat}"]
            assert 0.0 <= rate <= 1.0 and (rate * 2 * 16 * 2) == int(rate * 2 * 16 * 2)  # 32 games
    assert (out / "reward.png").is_file()


def test_frozen_opponent_trains_one_seat(tmp_path):
    out = tmp_path / "frozen"
    args = ["--task", "duel", "--task-args", '{"opponent": "frozen"}', "--steps", "2", "--eval-every", "1"]
    args += ["--beta", "0.0"]
    res = torchrun("--output-dir", str(out), *args, *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    records = metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    # one trained seat: no per-seat split of the training reward ...
    assert not any(k.startswith("reward_mean/") for r in records for k in r)
    # ... but evaluation puts the trained policy in each seat against a random player
    assert all("eval/win_rate/player_a" in r and "eval/win_rate/player_b" in r for r in records)
    assert [r["step"] for r in evaluations(out)] == [0, 1, 2]


BOTH = ["--task-args", '{"eval_opponents": ["random", "initial"]}']


def _against_both(evals: list[dict], games: int) -> None:
    """Each evaluation holds `games` games per seat against each opponent, with intervals."""
    for r in evals:
        for kind in ("random", "initial"):
            assert r[f"eval/rate/win_vs_{kind}_n"] == 2 * games
            low, rate, high = (r[f"eval/rate/win_vs_{kind}{k}"] for k in ("_low", "", "_high"))
            assert 0.0 <= low <= rate <= high <= 1.0
            for seat in ("player_a", "player_b"):
                assert r[f"eval/rate/win_vs_{kind}/{seat}_n"] == games
        # the two opponents' games together make the per-seat win rate
        for seat in ("player_a", "player_b"):
            both = (r[f"eval/rate/win_vs_random/{seat}"] + r[f"eval/rate/win_vs_initial/{seat}"]) / 2
            assert abs(r[f"eval/win_rate/{seat}"] - both) < 1e-9


def test_self_play_evaluated_against_the_initial_weights(tmp_path):
    # the frozen copy is built at the first evaluation, while training never uses it
    out = tmp_path / "duel"
    args = ["--task", "duel", *BOTH, "--steps", "2", "--eval-every", "2", "--beta", "0.0"]
    res = torchrun("--output-dir", str(out), *args, *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    evals = evaluations(out)
    assert [r["step"] for r in evals] == [0, 2]
    _against_both(evals, games=4 * 2)  # --eval-size 4 on 2 ranks


def test_deepspeed_zero3_self_play_with_micro_batches(tmp_path):
    # two trained seats: 8 conversations -> 16 trajectories -> 4 micro-batches of 4, which must
    # match DeepSpeed's accumulation steps; evaluation generates collectively under ZeRO-3, the
    # games against the initial weights with the frozen copy outside ZeRO
    out = tmp_path / "ds"
    args = ["--backend", "deepspeed", "--task", "duel", *BOTH, "--steps", "2", "--eval-every", "1"]
    res = torchrun("--output-dir", str(out), *args, *SMALL, "--micro-batch-size", "4")
    assert res.returncode == 0, res.stderr[-3000:]
    records = metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["step_skipped"] == 0 and r["grad_norm"] > 0 for r in records)
    assert all("reward_mean/player_b" in r and "eval/win_rate/player_b" in r for r in records)
    _against_both(evaluations(out), games=4 * 2)


def test_opponent_needs_a_multi_seat_task(tmp_path):
    res = python("--output-dir", str(tmp_path / "x"), "--task-args", '{"opponent": "random"}', *SMALL)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "--task guess: bad --task-args {'opponent': 'random'}" in res.stderr
    assert not (tmp_path / "x").exists()  # bad input writes nothing
