"""ms-swift's own rollout files, from its release wheel, with only their import lines changed.

The files are ms-swift's (Apache-2.0, not ours to ship): a test obtains them at test time.
`release_files(folder)` takes the wheel from the cache `$INTERLENS_ASSETS/ms-swift-wheel`
(downloading it there with `pip download --no-deps ms-swift==4.6.0` when it is missing),
reads `swift/rollout/multi_turn.py` and `gym_env.py` from it, rewrites their import lines by
`REWRITES` and writes them into `folder`, a plugin folder: `multi_turn.py`'s relative
`from .gym_env import Env, envs` then finds its neighbour as in ms-swift's package. When the
wheel can be neither found nor downloaded, `ReleaseUnavailable` says why (no silent skip).

The rewrite table, applied to lines starting `from swift.` (any other `from swift.` line is
an error, so a release that imports something new fails here, naming the line):

| ms-swift import                          | becomes                                  |
|------------------------------------------|------------------------------------------|
| `from swift.infer_engine.protocol import`| `from interlens_mcore.compat.swift import`|
| `from swift.template import`             | `from interlens_mcore.compat.swift import`|
| `from swift.template.utils import`       | `from interlens_mcore.compat.swift import`|
| `from swift.utils import`                | `from interlens_mcore.compat.swift import`|
| `from swift.rewards.orm import`          | `from interlens_mcore.compat.swift import`|
| `from swift.infer_engine import GRPOVllmEngine` | kept: under `if TYPE_CHECKING:`, never run |
| `from swift.template import StdTemplateInputs`  | kept: in ms-swift's own `run()` path only  |
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "4.6.0"
FILES = ("multi_turn.py", "gym_env.py")
OURS = "from interlens_mcore.compat.swift import"
REWRITES = {
    "from swift.infer_engine.protocol import": OURS,
    "from swift.template import": OURS,
    "from swift.template.utils import": OURS,
    "from swift.utils import": OURS,
    "from swift.rewards.orm import": OURS,
}
# never run here: a type hint (TYPE_CHECKING), and a lazy import of ms-swift's own run() path
KEPT = ("from swift.infer_engine import GRPOVllmEngine", "from swift.template import StdTemplateInputs")
_FROM = re.compile(r"^(\s*)(from swift\.[\w.]+ import)")


class ReleaseUnavailable(RuntimeError):
    """The ms-swift wheel is not in the cache and could not be downloaded."""


def cache_folder() -> Path:
    base = os.environ.get("INTERLENS_ASSETS")
    if not base:
        raise ReleaseUnavailable("set INTERLENS_ASSETS: the ms-swift wheel is cached under it")
    return Path(base) / "ms-swift-wheel"


def wheel() -> Path:
    """The cached ms-swift wheel, downloaded first if it is not there."""
    folder = cache_folder()
    name = f"ms_swift-{VERSION}-py3-none-any.whl"
    if not (folder / name).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"ms-swift=={VERSION}"]
        cmd += ["-d", str(folder)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise ReleaseUnavailable(f"`{' '.join(cmd)}` did not finish in 300 s (no network?)") from None
        if proc.returncode != 0 or not (folder / name).is_file():
            raise ReleaseUnavailable(
                f"ms-swift {VERSION} is not in {folder} and `{' '.join(cmd)}` failed (no network?); "
                f"put {name} there by hand to run offline:\n{proc.stderr[-1500:]}"
            )
    return folder / name


def rewrite(source: str, filename: str) -> str:
    """`source` with each `from swift.X import` line rewritten by `REWRITES`, nothing else."""
    out = []
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        found = _FROM.match(line)
        if found and not line.strip().startswith(KEPT):
            head = found.group(2)
            if head not in REWRITES:
                raise ValueError(f"{filename}:{number}: no rewrite for {line.strip()!r}: add one to REWRITES")
            line = found.group(1) + REWRITES[head] + line[found.end() :]
        out.append(line)
    return "".join(out)


def release_files(folder: Path) -> list[Path]:
    """ms-swift's multi_turn.py and gym_env.py, import lines rewritten, written into `folder`."""
    paths = []
    with zipfile.ZipFile(wheel()) as zf:
        for name in FILES:
            text = zf.read(f"swift/rollout/{name}").decode()
            (folder / name).write_text(rewrite(text, name))
            paths.append(folder / name)
    return paths
