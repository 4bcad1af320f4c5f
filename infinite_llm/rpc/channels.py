"""Client channels with the server's options, and deadlines that shrink as a request travels.

Every call has a deadline (DESIGN.md §4). :func:`aio_channel` gives calls without one the default and
forwards the current request id; both use TLS with the process's identity (``rpc/tls.py``) unless given
``tls`` (``None``: plaintext). :class:`Deadline` carries one absolute deadline across several calls
(``timeout=deadline.remaining()``), e.g. from an incoming call's context to the calls it makes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from infinite_llm.core.errors import DeadlineExceeded
from infinite_llm.rpc.interceptors import DefaultDeadlineInterceptor, RequestIdClientInterceptor
from infinite_llm.rpc.options import DEFAULT_TIMEOUT_S, channel_options, check_target, merged
from infinite_llm.rpc.tls import FROM_PROCESS, TlsArg, resolve


def aio_channel(
    target: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    extra_options: Sequence[tuple[str, int | str]] = (),
    tls: TlsArg = FROM_PROCESS,
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target`` (``host:port``) with the shared options: mTLS with ``tls``
    (default: the process's identity; ``None``: plaintext). ``extra_options`` override shared ones.
    Raises ``ValueError`` for a port out of range (:func:`~infinite_llm.rpc.options.check_target`).

    Calls without a ``timeout`` get ``timeout_s`` seconds; calls carry the current request id.
    """
    check_target(target)
    chain = [RequestIdClientInterceptor(), DefaultDeadlineInterceptor(timeout_s), *interceptors]
    identity = resolve(tls)
    if identity is None:
        return grpc.aio.insecure_channel(target, options=merged(channel_options(), extra_options), interceptors=chain)
    options = merged(channel_options(), identity.channel_options(), extra_options)
    return grpc.aio.secure_channel(target, identity.channel_credentials(), options=options, interceptors=chain)


def sync_channel(
    target: str, tls: TlsArg = FROM_PROCESS, extra_options: Sequence[tuple[str, int | str]] = ()
) -> grpc.Channel:
    """A blocking channel with the shared options (tools, tests); pass ``timeout=`` on each call.
    ``tls``: as for :func:`aio_channel`."""
    check_target(target)
    identity = resolve(tls)
    if identity is None:
        return grpc.insecure_channel(target, options=merged(channel_options(), extra_options))
    options = merged(channel_options(), identity.channel_options(), extra_options)
    return grpc.secure_channel(target, identity.channel_credentials(), options=options)


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline on the monotonic clock (seconds)."""

    expires_at: float

    @classmethod
    def after(cls, seconds: float = DEFAULT_TIMEOUT_S) -> Deadline:
        return cls(time.monotonic() + seconds)

    @classmethod
    def of_call(cls, context: grpc.aio.ServicerContext, cap: float = DEFAULT_TIMEOUT_S) -> Deadline:
        """The deadline of the call being served (at most ``cap`` seconds away)."""
        remaining = context.time_remaining()
        return cls.after(cap if remaining is None else min(remaining, cap))

    def remaining(self) -> float:
        """Seconds left, for ``timeout=``. Raises :class:`DeadlineExceeded` when none are."""
        left = self.expires_at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"deadline passed {-left:.3f} s ago")
        return left
