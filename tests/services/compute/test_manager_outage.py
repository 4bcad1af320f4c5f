"""A compute instance's placement while the global manager is away: retried with backoff, then
``Unavailable`` (the scheduler defers only the sequences that need rBlocks), at once for a moment after; a
release the manager cannot take is not an error, and does not wait the retries out again either. Real gRPC
against a port where nothing listens."""

from __future__ import annotations

import time

import pytest

from infinite_llm.core.dist_attention import HolderId
from infinite_llm.core.errors import Unavailable
from infinite_llm.services.compute.remote_kv import PLACE_RETRY_S, ManagerPlacement
from infinite_llm.state.etcd_launcher import free_port


def test_placement_retries_an_absent_manager_then_fails_fast_for_a_moment():
    placement = ManagerPlacement(f"127.0.0.1:{free_port()}", block_size=16, timeout_s=5.0, instance_id="c0")
    start = time.monotonic()
    with pytest.raises(Unavailable):
        placement.place("s", 1, 0)
    assert PLACE_RETRY_S <= time.monotonic() - start < PLACE_RETRY_S + 2.0  # retried with backoff
    assert placement.held_seq_ids() == []  # never placed: not reported as held
    start = time.monotonic()
    with pytest.raises(Unavailable, match="placement is paused for 1 s after a manager call failed with UNAVAILABLE"):
        placement.place("t", 1, 0)
    assert time.monotonic() - start < PLACE_RETRY_S / 2  # the next sequence does not wait the retries out again


def test_a_release_the_manager_cannot_take_frees_what_it_can_and_is_no_error():
    placement = ManagerPlacement(f"127.0.0.1:{free_port()}", block_size=16, timeout_s=5.0, instance_id="c0")
    # a holder whose address this instance never learned: nothing to free directly, the reconciler will
    start = time.monotonic()
    assert placement.release("s", [HolderId("attn-0")]) == 0
    assert PLACE_RETRY_S <= time.monotonic() - start < PLACE_RETRY_S + 2.0  # retried with backoff
    assert placement.held_seq_ids() == []
    start = time.monotonic()
    assert placement.release("t", [HolderId("attn-0")]) == 0
    assert time.monotonic() - start < PLACE_RETRY_S / 2  # the next release does not hold the engine thread again
    with pytest.raises(Unavailable, match="placement is paused for 1 s after a manager call failed with UNAVAILABLE"):
        placement.place("u", 1, 0)  # nor the next placement


def test_a_manager_that_takes_calls_and_never_answers_holds_the_step_at_most_the_optional_calls_deadline():
    """A frozen or wedged manager (it takes the call, never answers): the capacity read keeps the last view
    and prefix publishing gives up after ``OPTIONAL_CALL_S`` each, instead of holding every running
    sequence's step for the call's 30 s deadline (a walkthrough saw streams stall while a frozen leader held
    a ``PublishPrefix``). A real gRPC server whose GlobalManager handlers block."""
    import threading

    from infinite_llm.core.dist_attention import BlockId, BlockRef
    from infinite_llm.pb.v1 import manager_pb2 as mpb
    from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
    from infinite_llm.services.compute import remote_kv
    from tests.manager_stub import serving_manager

    wedged, release = threading.Event(), threading.Event()

    class Manager(mgrpc.GlobalManagerServicer):
        def GetClusterState(self, request, context):  # noqa: N802, ANN001, ANN201
            if wedged.is_set():
                release.wait(60)
            return mpb.ClusterStateResponse(servers=[mpb.ServerState(server_id="a", capacity_blocks=8, free_blocks=5)])

        def PublishPrefix(self, request, context):  # noqa: N802, ANN001, ANN201
            release.wait(60)
            return mpb.PublishPrefixResponse()

    with serving_manager(Manager()) as port:
        try:
            placement = ManagerPlacement(f"127.0.0.1:{port}", block_size=16, timeout_s=30.0, instance_id="c0")
            assert (placement.num_total_blocks, placement.num_free_blocks) == (8, 5)
            wedged.set()
            placement._capacity = (*placement._capacity[:2], 0.0)  # the view is due for a read
            start = time.monotonic()
            assert (placement.num_total_blocks, placement.num_free_blocks) == (8, 5)  # the last view stands
            assert remote_kv.OPTIONAL_CALL_S <= time.monotonic() - start < remote_kv.OPTIONAL_CALL_S + 1.5
            placement.publish("s", [(0, bytes(32), BlockRef(HolderId("a"), BlockId(0)))])
            start = time.monotonic()
            assert placement.flush_published() == 0
            assert time.monotonic() - start < remote_kv.OPTIONAL_CALL_S + 1.5
        finally:
            release.set()
