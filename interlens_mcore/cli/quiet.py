"""Filters for third-party warnings that tell a user of the launch scripts nothing they can act on.

Imported by the launch scripts before megatron-core or DeepSpeed. Only messages named here are
hidden; every warning of this package, and any other, still shows.
"""

from __future__ import annotations

import logging
import warnings

# megatron-core, when Apex / Transformer Engine are not installed (the CPU path needs neither)
for pattern in (r".*[Aa]pex.*", r".*Transformer Engine.*", r".*transformer_engine.*"):
    warnings.filterwarnings("ignore", message=pattern)
# DeepSpeed's and torch's deprecation notices about their own internals
warnings.filterwarnings("ignore", category=FutureWarning, module=r"deepspeed(\..*)?")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed(\..*)?")
# DeepSpeed's note that it picked its CPU accelerator (its logger's level is reset on import: a
# filter stays); every other DeepSpeed message still shows
logging.getLogger("DeepSpeed").addFilter(
    lambda record: "Setting accelerator to CPU" not in record.getMessage()
)
# megatron-core's TransformerConfig about a CUDA-graph option the CPU path never sets
warnings.filterwarnings("ignore", message=r"full scope is deprecated.*")
