"""Fixtures of the rpc tests: a background event loop for real grpc.aio servers."""

import warnings

import pytest

from tests.rpc.loop_thread import LoopThread


@pytest.fixture(autouse=True)
def _zero_copy_decode_is_intended():
    """pytest resets warning filters per test; the codec's read-only ``frombuffer`` views are on purpose."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()
