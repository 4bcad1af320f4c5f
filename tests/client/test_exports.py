"""Every typed error a call can raise is importable from the SDK (``infinite_llm.client`` and
``infinite_llm.client.errors``), as the README's error list promises: a caller catches ``PermissionDenied``
or ``Unauthenticated`` by name without reaching into ``infinite_llm.core``."""

from __future__ import annotations

import infinite_llm.client as sdk
import infinite_llm.client.errors as sdk_errors
from infinite_llm.core import errors as core_errors


def _all_subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_all_subclasses(sub)}
    return found


def test_every_core_error_class_is_exported_by_the_sdk():
    classes = {c for c in _all_subclasses(core_errors.InfiniteLLMError) if c.__module__ == core_errors.__name__}
    classes.add(core_errors.InfiniteLLMError)
    assert {"PermissionDenied", "Unauthenticated", "KVMemoryLost", "QueueFull"} <= {c.__name__ for c in classes}
    for module in (sdk, sdk_errors):
        missing = sorted(c.__name__ for c in classes if getattr(module, c.__name__, None) is not c)
        assert missing == [], f"{module.__name__} lacks {missing}"
        assert {c.__name__ for c in classes} <= set(module.__all__)
