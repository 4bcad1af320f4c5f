"""AttentionServer: an attention-memory server holding rBlocks and computing partial attention.

``server.py`` (config, start/serve/main) -> ``servicer.py`` (gRPC, codec) -> ``holder.py`` (RManager plus
reservations, validation, migration) -> ``core.rmanager.RManager``.
"""

from infinite_llm.services.attention.holder import AttentionHolder
from infinite_llm.services.attention.server import AttentionServer, AttentionServerConfig, main, serve, start

__all__ = ["AttentionHolder", "AttentionServer", "AttentionServerConfig", "main", "serve", "start"]
