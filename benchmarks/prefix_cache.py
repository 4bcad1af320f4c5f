"""Cluster-wide prefix caching on the local mesh (issue 13): one long document, four questions, two per
compute instance.

One mesh (etcd, manager, 3 attention servers, 2 compute instances, plaintext on loopback). A ~4K-token
document (``--doc-tokens``) is asked 4 questions, one after the other, straight to the compute instances:
compute-0 first (cold: nothing is cached), then compute-1, compute-0, compute-1 (warm: the document's
rBlocks, prefilled by compute-0, are attached where they live; compute-1 reuses them with no copy). Per
request it prints the time to first token (seconds, from sending the request to the first streamed token)
and the prompt tokens served from the cache; then the warm/cold TTFT ratio per instance and the hit rate of
the 4 questions (hit tokens over looked-up tokens, from the instances' ``/metrics`` counters
``infinite_llm:prefix_cache_hits`` and ``..._queries``, vLLM's names). Greedy equality: the first question is
asked once more on compute-1 (warm, the other instance) and its answer must equal the cold one token for
token; ``--reference`` also checks all 4 answers against the in-process engine with prefix caching off (4
more cold 4K prefills: slow on a loaded 2-core machine). The last line is
``prefix cache: warm/cold TTFT X.XXx, hit rate Y%`` (mean warm TTFT over the cold TTFT). Target: <= 0.2x.
SmolLM2-135M-Instruct fp32 on CPU by default. Run: ``.venv/bin/python benchmarks/prefix_cache.py``.
"""

from __future__ import annotations

import argparse
import time
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from infinite_llm.core.rmanager import KVLayout
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.mesh import LocalMesh, MeshConfig
from infinite_llm.models.registry import load_model_files, resolve_model
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.state.etcd_launcher import free_port

BLOCK_SIZE = 16
LICENSES = "/usr/share/common-licenses/"
DOCUMENT = open(LICENSES + "Apache-2.0", encoding="utf-8").read() + open(LICENSES + "GPL-3", encoding="utf-8").read()
QUESTIONS = (
    "\n\nQuestion: Which licenses does this document contain? Answer:",
    "\n\nQuestion: May I sell copies of the software? Answer:",
    "\n\nQuestion: What must I include when I redistribute it? Answer:",
    "\n\nQuestion: Is there any warranty? Answer:",
)
ORDER = (0, 1, 0, 1)  # the compute instance asked each question (the first one is cold)


@dataclass
class Answer:
    instance: int
    ttft_s: float
    token_ids: list[int]
    hit_tokens: int


def ask(address: str, ids: list[int], max_tokens: int, rid: str) -> tuple[float, list[int]]:
    """Greedy generation on one compute instance; returns (seconds to the first token, token ids)."""
    request = gpb.GenerateRequest(
        request_id=rid,
        token_ids=gpb.TokenIds(ids=ids),
        sampling=gpb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    tokens: list[int] = []
    first = None
    with sync_channel(address, tls=None) as ch:
        start = time.perf_counter()
        for reply in cgrpc.ComputeInstanceStub(ch).Generate(request, timeout=900):
            if first is None and reply.token_ids:
                first = time.perf_counter() - start
            tokens.extend(reply.token_ids)
    assert first is not None, f"{rid}: no token came back"
    return first, tokens


def scrape(address: str, name: str) -> float:
    """The value of counter ``name`` (without ``_total``) on a /metrics endpoint."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise KeyError(name)


def cold_answers(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer from the in-process engine with prefix caching off (every token computed)."""
    model_config, state_dict, tokenizer = load_model_files(resolve_model(None))
    num_blocks = max(len(p) for p in prompts) // BLOCK_SIZE + max_tokens // BLOCK_SIZE + 8  # one request at a time
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, enable_prefix_caching=False)
    engine = LLMEngine.from_weights(model_config, state_dict, tokenizer, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc-tokens", type=int, default=4096, help="tokens of the shared document")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per answer")
    ap.add_argument("--kv-memory-mib", type=int, default=160, help="KV memory per attention server (MiB)")
    ap.add_argument("--reference", action="store_true", help="also check every answer against the in-process engine")
    args = ap.parse_args()

    _, _, tokenizer = load_model_files(resolve_model(None))
    doc = tokenizer.encode(DOCUMENT)[: args.doc_tokens]
    prompts = [doc + tokenizer.encode(q) for q in QUESTIONS]
    layout = KVLayout(30, BLOCK_SIZE, 3, 64)  # SmolLM2-135M, fp32
    config = MeshConfig(
        attention_servers=3,
        compute_instances=2,
        kv_memory_bytes=args.kv_memory_mib << 20,
        router_port=free_port(),
        gateway_port=free_port(),
        block_size=BLOCK_SIZE,
        member_ttl_s=5,
        insecure=True,
    )
    print(f"document: {len(doc)} tokens ({len(doc) // BLOCK_SIZE} rBlocks of {BLOCK_SIZE}); "
          f"{args.kv_memory_mib} MiB per attention server = {(args.kv_memory_mib << 20) // layout.bytes_per_block} "
          f"rBlocks; {args.max_tokens} greedy tokens per answer")  # fmt: skip
    answers: list[Answer] = []
    with LocalMesh(config) as mesh:
        computes = mesh.compute_instances()
        for i, (instance, prompt) in enumerate(zip(ORDER, prompts, strict=True)):
            metrics = computes[instance].metrics_address
            hits_before = scrape(metrics, "infinite_llm:prefix_cache_hits")
            ttft, tokens = ask(computes[instance].address, prompt, args.max_tokens, f"q{i}")
            hit = int(scrape(metrics, "infinite_llm:prefix_cache_hits") - hits_before)
            answers.append(Answer(instance, ttft, tokens, hit))
            print(f"q{i + 1} on compute-{instance}: {len(prompt)} prompt tokens, {hit} from the cache, "
                  f"TTFT {ttft:.2f} s")  # fmt: skip
        queries = sum(scrape(c.metrics_address, "infinite_llm:prefix_cache_queries") for c in computes)
        hits = sum(scrape(c.metrics_address, "infinite_llm:prefix_cache_hits") for c in computes)
        ttft, again = ask(computes[1].address, prompts[0], args.max_tokens, "q1-again")
        print(f"q1 again on compute-1 (warm): TTFT {ttft:.2f} s; greedy answer equal to the cold one: "
              f"{again == answers[0].token_ids}")  # fmt: skip
    cold = answers[0].ttft_s
    for instance in (0, 1):
        warm = [a.ttft_s for a in answers[1:] if a.instance == instance]
        print(f"compute-{instance}: warm TTFT {sum(warm) / len(warm):.2f} s = {sum(warm) / len(warm) / cold:.2f}x "
              f"cold ({cold:.2f} s)")  # fmt: skip
    if args.reference:
        references = cold_answers(prompts, args.max_tokens)
        same = [a.token_ids == r for a, r in zip(answers, references, strict=True)]
        print(f"greedy answers equal to the cold in-process answers: {sum(same)}/{len(same)}")
    warm_mean = sum(a.ttft_s for a in answers[1:]) / (len(answers) - 1)
    print(f"prefix cache: warm/cold TTFT {warm_mean / cold:.2f}x, hit rate {100.0 * hits / queries:.0f}%")


if __name__ == "__main__":
    main()
