"""AttentionServer: an attention-memory server holding rBlocks and computing partial attention.

``server.py`` (config, start/serve/main) -> ``servicer.py`` (gRPC, codec) -> ``holder.py`` (RManager plus
reservations, validation, migration) -> ``core.rmanager.RManager``.
"""

from infinite_llm.services.attention.served_rmanager import ServedRManager
from infinite_llm.services.attention.server import AttentionServer, AttentionServerConfig, main, serve, start

__all__ = ["ServedRManager", "AttentionServer", "AttentionServerConfig", "main", "serve", "start"]
