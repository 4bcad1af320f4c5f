"""Every tensor of the step path is made on the device where it is used (issue: the engine failed on its
first CUDA step). CI has no GPU: :class:`tests.device_guard.DeviceGuard` catches the whole kind of fault on
CPU, in an engine step (prefill and decode, 2 partitions, greedy and sampled) and an attention-server step."""

import torch

from infinite_llm.core.rmanager import KVLayout, RManager, SeqStep
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.services.attention.served_rmanager import ServedRManager
from tests.device_guard import PACKAGE, DeviceGuard


def test_engine_steps_create_every_tensor_on_an_explicit_device(make_engine):
    engine = make_engine(num_kv_blocks=64, num_partitions=2, block_size=4)
    engine.add_request("The capital of France is", SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("Once upon a time", SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=1))
    guard = DeviceGuard()
    with guard:
        while engine.has_unfinished():
            engine.step()
    assert guard.violations == []


def test_an_attention_server_step_creates_every_tensor_on_an_explicit_device():
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    holder = ServedRManager(RManager(8, layout))
    r = holder.reserve("s", 3)
    holder.commit(r.reservation_id, [0, 1, 2])
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    guard = DeviceGuard()
    with guard:
        step = holder.open_step([SeqStep("s", 4, 6)], num_heads=4)
        for layer in range(2):
            holder.attend_layer(step, layer, q, kv[:6], kv[:6])
    assert guard.violations == []


def test_the_guard_catches_an_index_built_without_a_device_and_mixed_devices():
    """Code compiled under the package's path, doing what ``prepare()`` once did: ``torch.tensor(rows)``."""
    source = "import torch\ndef index(rows, like):\n    return like[torch.tensor(rows)]\n"
    scope: dict = {}
    exec(compile(source, f"{PACKAGE}/fake_step.py", "exec"), scope)  # noqa: S102 - a fixed test snippet
    guard = DeviceGuard()
    with guard:
        scope["index"]([0, 1], torch.zeros(3, device="meta"))
    assert guard.violations == [
        "infinite_llm/fake_step.py:3: tensor() without device=",
        "infinite_llm/fake_step.py:3: __getitem__ mixes ['cpu', 'meta']",
    ]
