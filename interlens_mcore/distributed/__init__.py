"""The one package that touches torch.distributed and megatron-core's parallel_state.

Call sites read `distributed.all_gather_object(...)`, `distributed.build_groups(...)`: every
public name of the four modules is here.
- `collectives`: the helpers (`group=None` is the world; a no-op at one rank), the stages and
  local phases that keep every rank in the same collective;
- `groups`: process-group set-up and the frozen `ParallelGroups` every other module receives;
- `failure`: the world check, one rank's error named on every rank (`WorldFailure`);
- `checkpoint`: sharded checkpoint I/O (`Block`, `save_sharded`, `load_sharded`);
- `safe_load`: reading checkpoints without unpickling code (imported as a module).
"""

from .checkpoint import Block, load_sharded, save_sharded, saved_shapes
from .collectives import (
    CollectiveError,
    CollectiveInLocalPhase,
    all_gather_object,
    all_gather_small,
    all_gather_tensor,
    all_reduce,
    all_reduce_replicated,
    barrier,
    barrier_or_gone,
    broadcast_tensor,
    current_stage,
    is_initialized,
    local_phase,
    rank,
    stage,
    world_size,
)
from .failure import WorldFailure, check_world, world_check_group
from .groups import (
    ParallelGroups,
    build_groups,
    check_layout,
    check_restartable,
    destroy,
    init_distributed,
    init_megatron,
    launcher_store,
    megatron_tp_group,
    side_groups,
)

__all__ = [
    "Block",
    "CollectiveError",
    "CollectiveInLocalPhase",
    "ParallelGroups",
    "WorldFailure",
    "all_gather_object",
    "all_gather_small",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_replicated",
    "barrier",
    "barrier_or_gone",
    "broadcast_tensor",
    "build_groups",
    "check_layout",
    "check_world",
    "current_stage",
    "destroy",
    "check_restartable",
    "init_distributed",
    "init_megatron",
    "is_initialized",
    "launcher_store",
    "load_sharded",
    "local_phase",
    "megatron_tp_group",
    "rank",
    "save_sharded",
    "saved_shapes",
    "side_groups",
    "stage",
    "world_check_group",
    "world_size",
]
