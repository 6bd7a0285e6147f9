"""megatron-core backend pieces: layer specs, HF <-> megatron weights, a colocated engine.

Importing this subpackage imports megatron-core; the rest of interlens_mcore does not need it.
"""

from . import checkpoint
from .convert import export_hf, gather_hf_state_dict, load_hf_weights
from .engine import MegatronEngine, sample_vocab_parallel
from .model import ModelLayout, build_model, forward_logits, layout_from_hf_config, load_layout
from .weights import (
    copy_hf_files,
    hf_to_megatron,
    is_megatron_checkpoint,
    load_model,
    load_weights,
    megatron_to_hf,
)

__all__ = [
    "MegatronEngine",
    "ModelLayout",
    "build_model",
    "checkpoint",
    "copy_hf_files",
    "export_hf",
    "forward_logits",
    "gather_hf_state_dict",
    "hf_to_megatron",
    "is_megatron_checkpoint",
    "layout_from_hf_config",
    "load_hf_weights",
    "load_layout",
    "load_model",
    "load_weights",
    "megatron_to_hf",
    "sample_vocab_parallel",
]
