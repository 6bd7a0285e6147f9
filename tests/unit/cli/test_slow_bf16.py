"""`--bf16` on a CPU that emulates bfloat16: the start-up warning, from the CPU's own flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from interlens_mcore.cli.args import parse
from interlens_mcore.cli.sizes import slow_bf16

EPYC = "fpu vme sse sse2 avx f16c fma avx2 bmi2 sha_ni vaes"  # a Zen 3 core: no bfloat16 instructions


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text("".join(f"processor\t: {i}\nflags\t\t: {flags}\n\n" for i in range(2)))
    return path


@pytest.mark.parametrize(
    ("flags", "bf16", "warns"),
    [
        (EPYC, True, True),
        (EPYC + " avx512f avx512_bf16", True, False),  # AVX512-BF16
        (EPYC + " amx_bf16 amx_tile", True, False),  # AMX
        (EPYC, False, False),  # float32 asked for
        ("fp asimd evtstrm", True, False),  # an arm64 flags list: not judged
    ],
)
def test_the_warning_follows_the_cpus_flags(tmp_path, flags, bf16, warns):
    args = parse(["--bf16", str(bf16).lower()], description="test")
    message = slow_bf16(args, _cpuinfo(tmp_path, flags))
    assert (message is not None) == warns
    if warns:
        assert (
            message.startswith("--bf16 on a CPU without bfloat16 instructions") and "drop --bf16" in message
        )


def test_an_unreadable_cpuinfo_gives_no_warning(tmp_path):
    assert slow_bf16(parse(["--bf16", "true"], description="test"), tmp_path / "missing") is None


def test_this_machine_is_judged_by_its_own_flags():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if "avx2" not in flags:
        pytest.skip("not an x86 Linux machine: /proc/cpuinfo has no x86 flags to judge")
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert (slow_bf16(parse(["--bf16", "true"], description="test")) is None) == native
