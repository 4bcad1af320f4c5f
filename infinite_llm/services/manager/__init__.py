"""Global manager (gManager): membership, capacity view and rBlock placement ledger in etcd.

:class:`GlobalManager` is the core object; a gRPC servicer wraps it. Key layout: see :mod:`.records`.
"""

from infinite_llm.services.manager.leadership import NotLeader
from infinite_llm.services.manager.local import LocalServers
from infinite_llm.services.manager.manager import GlobalManager, ManagerConfig
from infinite_llm.services.manager.membership import Registration
from infinite_llm.services.manager.placement import BlockServers, choose_servers
from infinite_llm.services.manager.records import ClusterState, Grant, Member, MemberInfo, MemberState

__all__ = [
    "BlockServers",
    "ClusterState",
    "GlobalManager",
    "Grant",
    "LocalServers",
    "ManagerConfig",
    "Member",
    "MemberInfo",
    "MemberState",
    "NotLeader",
    "Registration",
    "choose_servers",
]
