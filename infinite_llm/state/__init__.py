"""Durable cluster state: the one etcd client of the process (``etcd_store``) and a local etcd launcher.

Nothing is imported here on purpose: ``etcd_launcher`` must stay usable without importing the gRPC etcd
client (only one such client may be imported per process, ENV.md).
"""
