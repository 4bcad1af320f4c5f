"""The gateway tests' real router (an 8192-token model's, its only compute instance unreachable)."""

from tests.services.gateway.conftest import router_address, tokenizer  # noqa: F401  (fixtures)
