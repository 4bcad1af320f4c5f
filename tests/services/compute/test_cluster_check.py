"""A compute instance's startup check of the cluster (``ManagerPlacement.check_cluster``): real attention
servers on loopback, listed by a stand-in manager. An instance whose model or dtype needs other KV than a
server keeps is refused before it serves (every step would be refused, and every request fail as if the
client had erred); a server that does not answer is skipped."""

from __future__ import annotations

import pytest
import torch

from infinite_llm.core.errors import FailedPrecondition
from infinite_llm.core.rmanager import KVLayout
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.services.compute.remote_kv import ManagerPlacement
from infinite_llm.state.etcd_launcher import free_port
from tests.manager_stub import serving_manager

SERVED = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.fixture
def cluster(make_server):
    """Two real servers keeping ``SERVED`` KV, and a third listed at a port nobody serves; yields the
    manager's address."""
    servers = [make_server(4, SERVED, f"attn-{i}")[0] for i in range(2)]
    listed = [(f"attn-{i}", s.address) for i, s in enumerate(servers)] + [("attn-gone", f"127.0.0.1:{free_port()}")]

    class Manager(mgrpc.GlobalManagerServicer):
        def GetClusterState(self, request, context):  # noqa: N802, ANN001, ANN201
            states = [mpb.ServerState(server_id=i, address=a, block_size=SERVED.block_size) for i, a in listed]
            return mpb.ClusterStateResponse(servers=states)

    with serving_manager(Manager()) as port:
        yield f"127.0.0.1:{port}"


def test_an_instance_whose_model_and_dtype_match_the_servers_starts(cluster):
    ManagerPlacement(cluster, block_size=4, timeout_s=5.0).check_cluster(SERVED)  # attn-gone is skipped


@pytest.mark.parametrize(
    ("change", "needs"),
    [
        (dict(dtype=torch.bfloat16), "bfloat16 for 2 layers x 2 KV heads x 8"),
        (dict(head_dim=16), "float32 for 2 layers x 2 KV heads x 16"),
        (dict(num_layers=3), "float32 for 3 layers x 2 KV heads x 8"),
        (dict(num_kv_heads=1), "float32 for 2 layers x 1 KV heads x 8"),
    ],
)
def test_an_instance_needing_other_kv_than_a_server_keeps_is_refused_saying_both(cluster, change, needs):
    layout = KVLayout(**{**SERVED.__dict__, **change})
    with pytest.raises(FailedPrecondition) as refused:
        ManagerPlacement(cluster, block_size=4, timeout_s=5.0).check_cluster(layout)
    message = str(refused.value)
    assert "attention server attn-0 keeps KV as float32 for 2 layers x 2 KV heads x 8" in message
    assert f"need {needs}" in message
