"""A refusal that torchrun's restarts keep: a restarted worker of a refused run exits 2 at once.

torchrun restarts a failed worker group up to --max-restarts times, and a refused run fails.
Tried again, a refusal that depended on the moment would not hold: two `--resume auto` runs in
one folder, the second refused because the first holds the folder, would both end "done" once
the first finished and a restart of the second found the folder free. The first refusal is
written to the agent's store, which outlives the restarts, and a restarted worker reads it
before anything else (its line was printed once, by the first attempt).

The store also keeps the one line printed: rank 0 prints it, and torchrun stops every worker at
the first exit, so the other ranks wait (a minute at most) until rank 0 has recorded it.
"""

from __future__ import annotations

import datetime
import os

from interlens_mcore import distributed

KEY = "interlens/refused"
WAIT_FOR_RANK_0_S = 60.0


def record(message: str) -> None:
    """Keep `message` for this torchrun's later attempts (nothing outside torchrun).

    Rank 0 first: the other ranks return once it has (or after `WAIT_FOR_RANK_0_S`).
    """
    store = distributed.launcher_store()
    if store is None:
        return
    if os.environ.get("RANK", "0") != "0":
        try:
            store.wait([KEY], datetime.timedelta(seconds=WAIT_FOR_RANK_0_S))
        except RuntimeError:  # DistStoreError: rank 0 never got there (it was killed)
            pass
    store.set(KEY, message)


def recorded() -> str | None:
    """The refusal an earlier attempt of this torchrun recorded, or None (always on a first attempt)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return None
    store = distributed.launcher_store()
    if store is None or not store.check([KEY]):
        return None
    return store.get(KEY).decode()
