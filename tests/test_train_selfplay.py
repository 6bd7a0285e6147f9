"""`launch/train_grpo.py --env duel`: two trained seats (self-play) or one against a frozen copy."""

from __future__ import annotations

from train_utils import SMALL, metrics, python, torchrun


def test_self_play_logs_each_seat_and_win_rates(tmp_path):
    out = tmp_path / "duel"
    res = torchrun("--output-dir", str(out), "--env", "duel", "--steps", "3", "--eval-every", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    records = metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert 0.0 <= r["reward_mean/player_a"] <= 1.0 and 0.0 <= r["reward_mean/player_b"] <= 1.0
        assert r["timeouts"] == 0
    # evaluations at step 0, every 2 steps, and at the last step; a tie counts half a win
    evaluated = [r["step"] for r in records if "eval/win_rate/player_a" in r]
    assert evaluated == [0, 2]
    for r in records[0], records[2]:
        for seat in ("player_a", "player_b"):
            rate = r[f"eval/win_rate/{seat}"]
            assert 0.0 <= rate <= 1.0 and (rate * 2 * 16 * 2) == int(rate * 2 * 16 * 2)  # 32 games
    assert (out / "reward.png").is_file()


def test_frozen_opponent_trains_one_seat(tmp_path):
    out = tmp_path / "frozen"
    args = ["--env", "duel", "--opponent", "frozen", "--steps", "2", "--eval-every", "0", "--beta", "0.0"]
    res = torchrun("--output-dir", str(out), *args, *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    records = metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    # one trained seat: no per-seat split, and no evaluation was asked for
    assert not any(k.startswith(("reward_mean/", "eval/")) for r in records for k in r)


def test_opponent_needs_a_multi_seat_env(tmp_path):
    res = python("--output-dir", str(tmp_path / "x"), "--opponent", "random", *SMALL)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "--opponent random needs --env duel" in res.stderr
    assert not (tmp_path / "x").exists()  # bad input writes nothing
