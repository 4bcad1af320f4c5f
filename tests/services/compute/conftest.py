"""The attention-server fixtures (real servers on loopback), shared with the compute-side tests."""

from tests.services.attention.conftest import _zero_copy_decode_is_intended, loop, make_pair, make_server  # noqa: F401
