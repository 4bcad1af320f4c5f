"""gRPC plumbing shared by every service: tensor codec, server builder, channels, interceptors, options.

Services (``infinite_llm/services/``) build on this package; ``core/`` never imports it.
"""
