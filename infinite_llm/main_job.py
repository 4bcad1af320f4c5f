"""The main job (``make run``): a question about a real long document, answered through the mesh.

Brings up the local mesh with attention servers whose ``--kv-memory`` is each too small for the job's
context, streams the answer to a question about a document that ships with the OS (thousands of tokens),
then prints how the request's rBlocks were spread over the servers and the tokens/s.
Run: ``python -m infinite_llm.main_job [--doc PATH] [--question TEXT] [--attention-servers N]``.

Bad input (a document that is missing, not a file, not UTF-8 text or empty; counts below 1; a document
longer than the model's context) exits 2 with one line on stderr, before the mesh starts; an error the
mesh returns exits 1 with one line.
"""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.table import Table

from infinite_llm.client import Client
from infinite_llm.client.errors import InfiniteLLMError
from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.rmanager import KVLayout
from infinite_llm.mesh import LocalMesh, MeshConfig
from infinite_llm.models.registry import load_model_config, load_tokenizer, resolve_model

DOC = "/usr/share/common-licenses/Apache-2.0"
QUESTION = "According to this license, what must you do when you redistribute the Work? Answer briefly."
out = Console(soft_wrap=True)  # lines are not cut at 80 columns when stdout is not a terminal
err = Console(stderr=True, soft_wrap=True)


class BadInput(ValueError):
    """A flag the job cannot run with; its message is the one line the user sees."""


def read_document(doc: str) -> str:
    """The document's text (a UTF-8 byte order mark dropped). Raises ``BadInput`` when it is missing, not a
    regular file, unreadable, not UTF-8 text, or empty."""
    try:
        with open(doc, encoding="utf-8") as f:
            text = f.read().removeprefix("\ufeff")
    except FileNotFoundError:
        raise BadInput(f"--doc {doc}: no such file") from None
    except IsADirectoryError:
        raise BadInput(f"--doc {doc}: is a directory, not a file") from None
    except PermissionError:
        raise BadInput(f"--doc {doc}: not readable (permission denied)") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"--doc {doc}: not UTF-8 text (byte {e.start} cannot be decoded)") from None
    except OSError as e:
        raise BadInput(f"--doc {doc}: cannot be read ({e.strerror})") from None
    if not text.strip():
        raise BadInput(f"--doc {doc}: the document is empty")
    return text


def check_counts(a: argparse.Namespace) -> None:
    """Raises ``BadInput`` for a count below 1 or an empty question."""
    for flag in ("attention_servers", "max_tokens", "block_size"):
        if getattr(a, flag) < 1:
            raise BadInput(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(a, flag)}")
    if not a.question.strip():
        raise BadInput("--question is empty")


def build_prompt(tokenizer, text: str, question: str) -> list[int]:  # noqa: ANN001
    content = f"{text}\n\nQuestion: {question}"
    templated = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return tokenizer.encode(templated, add_special_tokens=False)


def per_server_memory(model_config, prompt_tokens: int, max_tokens: int, servers: int, block_size: int) -> int:  # noqa: ANN001
    """Bytes per attention server: each holds ~45% of the job's KV, so no one server can hold it all."""
    layout = KVLayout(
        model_config.num_hidden_layers, block_size, model_config.num_key_value_heads, model_config.head_dim
    )
    blocks = -(-(prompt_tokens + max_tokens) // block_size)
    per_server = max(-(-blocks * 45 // 100), -(-blocks // servers) + 2)
    return per_server * layout.bytes_per_block


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Answer a question about a long document through the mesh.")
    ap.add_argument("--doc", default=DOC)
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--attention-servers", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    a = ap.parse_args(argv)
    try:
        check_counts(a)
        text = read_document(a.doc)
        resolved = resolve_model(None)
        model_config = load_model_config(resolved)
        tokenizer = load_tokenizer(resolved, model_config)
        ids = build_prompt(tokenizer, text, a.question)
        context = model_config.max_position_embeddings
        if len(ids) + a.max_tokens > context:
            raise BadInput(
                f"--doc {a.doc}: {len(ids)} prompt tokens + --max-tokens {a.max_tokens} exceed the model's "
                f"context of {context} tokens; use a shorter document"
            )
    except BadInput as e:
        err.print(f"error: {e}", markup=False, highlight=False)
        return 2
    kv_memory = per_server_memory(model_config, len(ids), a.max_tokens, a.attention_servers, a.block_size)
    job_kv = (
        len(ids)
        * KVLayout(
            model_config.num_hidden_layers, 1, model_config.num_key_value_heads, model_config.head_dim
        ).bytes_per_block
    )
    err.print(
        f"document {a.doc}: {len(ids)} prompt tokens, {job_kv / 2**20:.1f} MiB of KV; "
        f"{a.attention_servers} attention servers with {kv_memory / 2**20:.1f} MiB each"
    )
    config = MeshConfig(attention_servers=a.attention_servers, kv_memory_bytes=kv_memory, block_size=a.block_size)
    with err.status("starting the mesh (etcd, manager, attention servers, compute, router)...", spinner="dots"):
        mesh = LocalMesh(config).start()
    try:
        return ask(mesh, ids, a, len(ids))
    except InfiniteLLMError as e:  # the mesh refused or failed the request: one line, not a traceback
        out.print()
        err.print(f"error: {e}", markup=False, highlight=False)
        return 1
    finally:
        mesh.stop()


def ask(mesh: LocalMesh, ids: list[int], a: argparse.Namespace, prompt_tokens: int) -> int:
    out.print(f"[bold]Q:[/bold] {a.question}\n[bold]A:[/bold] ", end="")
    start = time.perf_counter()
    first = last = None
    with Client(mesh.router_address, tls=mesh.tls("client")) as client:
        for chunk in client.stream(ids, max_tokens=a.max_tokens, temperature=0):
            if first is None:
                first = time.perf_counter()
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
    end = time.perf_counter()
    out.print()
    assert last is not None and first is not None
    n = last.completion_tokens
    table = Table(
        title=f"where the request's {sum(last.placement.values())} rBlocks lived",
        caption=f"{prompt_tokens + n} tokens held in all; an rBlock holds {a.block_size} (the last ones partly, "
        "or none yet: placement runs a few rBlocks ahead)",
    )
    table.add_column("attention server")
    table.add_column("rBlocks", justify="right")
    table.add_column("room for tokens", justify="right")
    for server, blocks in sorted(last.placement.items()):
        table.add_row(server, str(blocks), str(blocks * a.block_size))
    out.print(table)
    out.print(
        f"prompt {prompt_tokens} tokens, prefill (time to first token) {first - start:.2f} s; "
        f"{n} new tokens, the {n - 1} after the first in {end - first:.2f} s: "
        f"{(n - 1) / max(end - first, 1e-9):.1f} tokens/s (finish: {last.finish_reason})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
