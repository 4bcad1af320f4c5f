from tests.etcd_server import etcd_prefix, etcd_server  # noqa: F401  (fixtures)
