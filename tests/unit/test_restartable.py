"""Multi-node torchrun with restarts over one shared rendezvous store is refused before it can hang."""

from __future__ import annotations

import pytest

from interlens_mcore.distributed import check_restartable


def test_several_nodes_restarting_over_a_shared_store_are_refused_naming_the_setting():
    env = {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(ValueError, match=r"torchrun with 2 nodes and --max-restarts > 0") as info:
        check_restartable(env)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in str(info.value) and "launch/multinode.sh" in str(
        info.value
    )


@pytest.mark.parametrize(
    "env",
    [
        {},  # not under torchrun
        {"GROUP_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "3"},  # one node: one agent restarts all
        {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"},
        # a fresh store every round (launch/multinode.sh)
        {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False"},
    ],
)
def test_one_node_or_no_restarts_pass(env):
    check_restartable(env)
