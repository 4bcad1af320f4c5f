"""Migration between attention servers: ExportBlocks streams a sequence's rBlocks, ImportBlocks publishes them
only after the whole stream arrived, and attention on the new holder equals attention on the old one."""

import math
import struct
import threading
import time

import grpc
import pytest
import torch

from infinite_llm.core.dist_attention import BlockRef
from infinite_llm.core.rmanager import KVLayout, SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.rpc import codec
from tests.services.attention.helpers import TIMEOUT, Pair, Steps

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)  # 1536 B per rBlock
NUM_HEADS = 4


def _stats(stub) -> tuple[int, int, int]:
    s = stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT)
    return s.num_free, s.num_used, s.num_reserved


@pytest.fixture
def source(make_pair):
    """Server A with sequence "s" on 3 rBlocks, prefilled with 10 tokens on every layer."""
    pair = make_pair(8, LAYOUT, "A")
    steps = Steps({"A": pair}, LAYOUT, NUM_HEADS)
    steps.place("s", ["A"] * 3)
    steps.step([SeqStep("s", 0, 10)])
    return pair.stub, steps


def _export(stub, chunk_bytes=1000) -> list[pb.BlockTransferChunk]:
    request = pb.ExportBlocksRequest(seq_id="s", chunk_bytes=chunk_bytes)
    return list(stub.ExportBlocks(request, timeout=TIMEOUT))


def _decode_on(steps: Steps, server: str, block_ids) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """One decode step (position 10) of "s" with its table on ``server``, every layer, same q/k/v per seed.

    The table flips as at the end of a migration: the new server recorded each rBlock's index at import.
    """
    steps.dist.replace_table("s", [BlockRef(server, b) for b in block_ids])
    steps.gen = torch.Generator().manual_seed(7)
    partials = steps.step([SeqStep("s", 10, 1)], check_dense=False)
    return [partials[layer][server] for layer in range(3)]


def _assert_same_partials(steps: Steps, server_c, stub_c, ids_a, ids_c) -> None:  # noqa: ANN001
    """One decode step of "s" over its rBlocks ``ids_a`` on A, then over ``ids_c`` on C: bitwise equal."""
    steps.pairs["C"] = Pair(stub_c, 8, LAYOUT, mirrored=False, address=server_c.address)  # compare A with C
    on_a = _decode_on(steps, "A", ids_a)
    on_c = _decode_on(steps, "C", ids_c)
    for (out_a, lse_a), (out_c, lse_c) in zip(on_a, on_c, strict=True):
        assert torch.equal(out_a, out_c) and torch.equal(lse_a, lse_c)


def test_export_then_import_gives_identical_partials_on_the_new_server(source, make_server):
    stub_a, steps = source
    server_c, stub_c = make_server(8, LAYOUT, "C")
    stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="x", num_blocks=2), timeout=TIMEOUT)  # ids 0, 1 taken
    r = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=3), timeout=TIMEOUT)
    chunks = _export(stub_a)
    header = chunks[0].header
    assert list(header.block_ids) == [0, 1, 2] and list(header.payload.shape) == [2, 3, 3, 4, 2, 8]
    assert list(header.block_indices) == [0, 1, 2]
    assert [len(c.data) for c in chunks[1:]] == [1000] * 4 + [3 * 1536 - 4000]
    header.reservation_id = r.reservation_id
    seen_mid_stream = []

    def stream():
        yield chunks[0]
        yield from chunks[1:3]
        # Half the data has arrived: nothing is readable yet.
        seen_mid_stream.append(_stats(stub_c))
        with pytest.raises(grpc.RpcError) as info:
            stub_c.ExportBlocks(pb.ExportBlocksRequest(seq_id="s"), timeout=TIMEOUT).next()
        seen_mid_stream.append(info.value.code())
        yield from chunks[3:]

    reply = stub_c.ImportBlocks(stream(), timeout=TIMEOUT)
    assert reply.seq_id == "s" and list(reply.block_ids) == list(r.block_ids) == [2, 3, 4]
    assert seen_mid_stream == [(3, 0, 5), grpc.StatusCode.NOT_FOUND]
    assert _stats(stub_c) == (3, 3, 2)
    _assert_same_partials(steps, server_c, stub_c, header.block_ids, reply.block_ids)


def test_import_without_a_reservation_reserves_on_the_header(source, make_server):
    stub_a, _ = source
    _, stub_c = make_server(8, LAYOUT, "C")
    chunks = _export(stub_a, chunk_bytes=0)  # default 1 MiB: all data in one chunk
    assert len(chunks) == 2
    reply = stub_c.ImportBlocks(iter(chunks), timeout=TIMEOUT)
    assert list(reply.block_ids) == [0, 1, 2] and _stats(stub_c) == (5, 3, 0)
    again = _export(stub_c)
    assert b"".join(c.data for c in again[1:]) == b"".join(c.data for c in chunks[1:])


def _truncated(chunks):
    return chunks[:-1]


def _no_header(chunks):
    return chunks[1:]


def _two_headers(chunks):
    return chunks[:2] + chunks[:1] + chunks[2:]


def _wrong_layout(chunks):
    chunks[0].header.payload.shape[3] = 8
    return chunks


def _overflow(chunks):
    return [*chunks, pb.BlockTransferChunk(data=b"x")]


def _with_value(value: float):
    """One fp32 value of the payload (the 2nd of its 2nd chunk) replaced by ``value``."""

    def mutate(chunks):
        data = chunks[2].data
        chunks[2].data = data[:4] + struct.pack("<f", value) + data[8:]
        return chunks

    return mutate


def _hashes(*hashes: bytes):
    def mutate(chunks):
        chunks[0].header.block_hashes.extend(hashes)
        return chunks

    return mutate


BAD_IMPORTS = {
    "truncated": (_truncated, "payload ended after 4000 of 4608 bytes"),
    "no_header": (_no_header, "must start with a header"),
    "two_headers": (_two_headers, "exactly one header"),
    "wrong_layout": (_wrong_layout, "does not match this server's layout"),
    "overflow": (_overflow, "overflows its declared size"),
    "nan": (_with_value(math.nan), "NaN or infinite"),
    "inf": (_with_value(-math.inf), "NaN or infinite"),
    "hash_count": (_hashes(b"h" * 16), "1 block hashes for 3 blocks"),
    "hash_length": (_hashes(b"", b"short", b""), "block hashes must be"),
}


@pytest.mark.parametrize("case", list(BAD_IMPORTS))
def test_a_failed_import_publishes_nothing_and_cancels_its_reservation(source, make_server, case):
    stub_a, _ = source
    _, stub_c = make_server(8, LAYOUT, "C")
    mutate, details = BAD_IMPORTS[case]
    r = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=3), timeout=TIMEOUT)
    chunks = _export(stub_a)
    chunks[0].header.reservation_id = r.reservation_id
    with pytest.raises(grpc.RpcError) as info:
        stub_c.ImportBlocks(iter(mutate(chunks)), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and details in info.value.details()
    expected = (5, 0, 3) if case in ("no_header", "wrong_layout") else (8, 0, 0)  # failed before/after the header
    assert _stats(stub_c) == expected
    assert stub_c.FreeSequence(pb.FreeSequenceRequest(seq_id="s"), timeout=TIMEOUT).num_freed == 0
    assert _stats(stub_c) == (8, 0, 0)


def test_import_into_another_sequences_reservation_is_refused(source, make_server):
    stub_a, _ = source
    _, stub_c = make_server(8, LAYOUT, "C")
    r = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="other", num_blocks=3), timeout=TIMEOUT)
    chunks = _export(stub_a)
    chunks[0].header.reservation_id = r.reservation_id
    with pytest.raises(grpc.RpcError) as info:
        stub_c.ImportBlocks(iter(chunks), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "holds 3 rBlocks of 'other', not 3 of 's'" in info.value.details()
    assert _stats(stub_c) == (5, 0, 3)  # the other sequence's reservation is untouched


def test_export_of_unknown_or_foreign_blocks_is_refused(source):
    stub_a, _ = source
    with pytest.raises(grpc.RpcError) as info:
        list(stub_a.ExportBlocks(pb.ExportBlocksRequest(seq_id="nope"), timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        list(stub_a.ExportBlocks(pb.ExportBlocksRequest(seq_id="s", block_ids=[1, 5]), timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    subset = list(stub_a.ExportBlocks(pb.ExportBlocksRequest(seq_id="s", block_ids=[2, 0]), timeout=TIMEOUT))
    assert list(subset[0].header.block_ids) == [2, 0]
    payload = codec.tensor_from_buffer(
        subset[0].header.payload.dtype, subset[0].header.payload.shape, b"".join(c.data for c in subset[1:])
    )
    full = list(stub_a.ExportBlocks(pb.ExportBlocksRequest(seq_id="s"), timeout=TIMEOUT))
    everything = codec.tensor_from_buffer("float32", full[0].header.payload.shape, b"".join(c.data for c in full[1:]))
    assert torch.equal(payload, everything[:, :, [2, 0]])


def test_a_cancelled_import_stream_cancels_its_reservation(source, make_server):
    stub_a, _ = source
    _, stub_c = make_server(8, LAYOUT, "C")
    chunks = _export(stub_a)
    stalled = threading.Event()

    def stream():
        yield from chunks[:2]
        stalled.wait(TIMEOUT)  # the rest never comes: the caller gives up

    call = stub_c.ImportBlocks.future(stream(), timeout=TIMEOUT)
    _poll(lambda: _stats(stub_c) == (5, 0, 3))  # the header arrived: blocks reserved, none published
    call.cancel()
    _poll(lambda: _stats(stub_c) == (8, 0, 0))
    stalled.set()
    assert call.cancelled()


def _poll(condition, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def _huge(header: pb.BlockTransferHeader) -> None:
    header.payload.shape[2] = 10**12  # would be ~1.5 PB: refused by the header check, never allocated


def _staged_without_reservation(header: pb.BlockTransferHeader) -> None:
    header.stage = True


def _staged_into_reservation_zero(header: pb.BlockTransferHeader) -> None:
    header.stage = True  # 0 reserves on arrival: an id nobody could commit or cancel
    header.reservation_ids[:] = [0]


@pytest.mark.parametrize(
    ("mutate", "details"),
    [
        (_huge, "the header gives 3 block_indices for payload shape [2, 3, 1000000000000"),
        (_staged_without_reservation, "a staged import lands in a reservation: set reservation_id"),
        (_staged_into_reservation_zero, "a staged import lands in a reservation: set reservation_id"),
    ],
)
def test_a_bad_header_is_refused_before_any_data(source, make_server, mutate, details):
    stub_a, _ = source
    _, stub_c = make_server(8, LAYOUT, "C")
    chunks = _export(stub_a)
    mutate(chunks[0].header)
    with pytest.raises(grpc.RpcError) as info:
        stub_c.ImportBlocks(iter(chunks), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details in info.value.details()
    assert _stats(stub_c) == (8, 0, 0)


def test_a_staged_import_is_read_by_no_step_until_committed_and_a_cancel_drops_it(source, make_server):
    """``stage``: the data lands in the reservation, which stays reserved (no export, no attention reads it);
    CommitBlocks then publishes it at the indices it gives, with partials identical to the source's; a staged
    import that is cancelled instead frees its rBlocks."""
    stub_a, steps = source
    server_c, stub_c = make_server(8, LAYOUT, "C")
    kept = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=3), timeout=TIMEOUT)
    dropped = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=3), timeout=TIMEOUT)
    for r in (kept, dropped):
        chunks = _export(stub_a)
        chunks[0].header.reservation_id, chunks[0].header.stage = r.reservation_id, True
        reply = stub_c.ImportBlocks(iter(chunks), timeout=TIMEOUT)
        assert list(reply.block_ids) == list(r.block_ids) and list(reply.cached_hashes) == []
    assert _stats(stub_c) == (2, 0, 6)  # both still reserved
    with pytest.raises(grpc.RpcError) as info:
        stub_c.ExportBlocks(pb.ExportBlocksRequest(seq_id="s"), timeout=TIMEOUT).next()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # the sequence holds nothing here yet
    stub_c.CancelReservation(pb.CancelReservationRequest(reservation_id=dropped.reservation_id), timeout=TIMEOUT)
    commit = pb.CommitBlocksRequest(reservation_id=kept.reservation_id, block_indices=[0, 1, 2])
    committed = stub_c.CommitBlocks(commit, timeout=TIMEOUT)
    assert list(committed.block_ids) == list(kept.block_ids) and list(committed.cached_hashes) == []
    assert _stats(stub_c) == (5, 3, 0)
    _assert_same_partials(steps, server_c, stub_c, chunks[0].header.block_ids, committed.block_ids)


def test_an_import_whose_reservation_ended_mid_stream_writes_nothing(source, make_server, monkeypatch):
    """The manager cancelled the reservation (or it expired) while its data streamed in, and another sequence
    took those rBlocks: the import fails NOT_FOUND and the other sequence's KV is untouched."""
    stub_a, _ = source
    server_c, stub_c = make_server(3, LAYOUT, "C")
    r = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=3), timeout=TIMEOUT)
    chunks = _export(stub_a)
    chunks[0].header.reservation_id = r.reservation_id
    # The cancel must come after the server took the header: sent earlier (on its own HTTP/2 stream) it can
    # arrive first, the import then fails at its header and returns while the stream below still runs.
    holder, begun = server_c.servicer.holder, threading.Event()
    begin_import = holder.begin_import

    def begin_import_and_tell(*args):  # noqa: ANN002, ANN202
        reservations = begin_import(*args)
        begun.set()
        return reservations

    monkeypatch.setattr(holder, "begin_import", begin_import_and_tell)

    def stream():
        yield from chunks[:2]
        assert begun.wait(TIMEOUT)
        stub_c.CancelReservation(pb.CancelReservationRequest(reservation_id=r.reservation_id), timeout=TIMEOUT)
        other = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="o", num_blocks=3), timeout=TIMEOUT)
        assert sorted(other.block_ids) == sorted(r.block_ids)
        commit = pb.CommitBlocksRequest(reservation_id=other.reservation_id, block_indices=[0, 1, 2])
        stub_c.CommitBlocks(commit, timeout=TIMEOUT)
        before.extend(_export_all(stub_c, "o"))
        yield from chunks[2:]

    before: list[bytes] = []
    with pytest.raises(grpc.RpcError) as info:
        stub_c.ImportBlocks(stream(), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert _export_all(stub_c, "o") == before and _stats(stub_c) == (0, 3, 0)


def _export_all(stub, seq_id: str) -> list[bytes]:  # noqa: ANN001
    return [c.data for c in stub.ExportBlocks(pb.ExportBlocksRequest(seq_id=seq_id), timeout=TIMEOUT)][1:]


def test_an_import_fills_several_reservations_in_order(source, make_server):
    """``reservation_ids``: the payload's blocks land in the reservations in order (here 1 + 2 rBlocks), each
    committed at its share of the header's indices; the export back gives the same bytes."""
    stub_a, _ = source
    _, stub_c = make_server(8, LAYOUT, "C")
    one = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=1), timeout=TIMEOUT)
    two = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=2), timeout=TIMEOUT)
    chunks = _export(stub_a)
    chunks[0].header.reservation_ids[:] = [two.reservation_id, one.reservation_id]
    reply = stub_c.ImportBlocks(iter(chunks), timeout=TIMEOUT)
    assert list(reply.block_ids) == [*two.block_ids, *one.block_ids]
    assert _stats(stub_c) == (5, 3, 0)
    again = list(stub_c.ExportBlocks(pb.ExportBlocksRequest(seq_id="s", block_ids=reply.block_ids), timeout=TIMEOUT))
    assert list(again[0].header.block_indices) == [0, 1, 2]
    assert b"".join(c.data for c in again[1:]) == b"".join(c.data for c in chunks[1:])


@pytest.mark.parametrize(
    ("case", "details"),
    [
        ("too_few", "reservations [{a}, {b}] holds 2 rBlocks of 's', not 3 of 's'"),
        ("foreign", "holds 3 rBlocks of 'o' and 's', not 3 of 's'"),
        ("both", "give reservation_id or reservation_ids, not both"),
        ("repeated", "reservation ids repeat"),
    ],
)
def test_a_bad_set_of_reservations_is_refused_before_any_data(source, make_server, case, details):
    stub_a, _ = source
    _, stub_c = make_server(8, LAYOUT, "C")
    a = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=1), timeout=TIMEOUT).reservation_id
    seq = "o" if case == "foreign" else "s"
    b = stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id=seq, num_blocks=2 if seq == "o" else 1), timeout=TIMEOUT)
    b = b.reservation_id
    chunks = _export(stub_a)
    header = chunks[0].header
    header.reservation_ids[:] = {"repeated": [a, a, b]}.get(case, [a, b])
    if case == "both":
        header.reservation_id = a
    with pytest.raises(grpc.RpcError) as info:
        stub_c.ImportBlocks(iter(chunks), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details.format(a=a, b=b) in info.value.details()
    assert _stats(stub_c)[2] == (3 if case == "foreign" else 2)  # both reservations untouched


@pytest.mark.parametrize("case", ["short", "repeated_index"])
def test_a_failed_import_into_several_reservations_cancels_them_all(source, make_server, case):
    """One chunk short, or indices that the second reservation's commit would refuse after the first's
    (checked for all before anything is written): nothing stays reserved or committed."""
    stub_a, _ = source
    _, stub_c = make_server(8, LAYOUT, "C")
    rids = [stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=n), timeout=TIMEOUT).reservation_id
            for n in (2, 1)]  # fmt: skip
    chunks = _export(stub_a)
    chunks[0].header.reservation_ids[:] = rids
    if case == "repeated_index":
        chunks[0].header.block_indices[:] = [0, 1, 1]
    with pytest.raises(grpc.RpcError) as info:
        stub_c.ImportBlocks(iter(chunks[:-1] if case == "short" else chunks), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _stats(stub_c) == (8, 0, 0)
