"""The single-process engine: continuous batching over DistAttention partitions, streaming, abort.

Wires the pure core together (model, rManagers, ``DistAttention`` over local rManagers, scheduler, runner, sampler) with
the tokenizer for text in and out. Every attention is computed as partition + merge over
``num_partitions`` rManagers (1 = plain paged attention), so this engine is the reference the mesh is
checked against. ``step()`` is the whole loop body; ``generate`` and ``stream`` drive it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE, ModelConfig
from infinite_llm.core.decode_graphs import DecodeGraphs
from infinite_llm.core.dist_attention import DistAttention, StepAttention
from infinite_llm.core.errors import ContextLengthExceeded, InvalidRequest, NotFound
from infinite_llm.core.ids import check_id
from infinite_llm.core.local_transport import LocalPlacement, LocalTransport, partition_id
from infinite_llm.core.model import LlamaForCausalLM
from infinite_llm.core.rmanager import KVLayout, RManager, SeqStep
from infinite_llm.core.runner import Interrupt, ModelRunner, StepInterrupted, StepResult
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.core.scheduler import BlockManager, Scheduler, SchedulerConfig, SchedulerOutput, Sequence
from infinite_llm.engine.outputs import RequestOutput, TextStopper
from infinite_llm.engine.structured import GrammarCompiler, mask_prefetch_for

# The model's name in the block hashes of a local engine's prefix cache: its index holds one model only.
LOCAL_MODEL_ID = "local"


class KVBackend(BlockManager, Protocol):
    """Block manager + attention over where the KV lives (local partitions or remote attention servers)."""

    @property
    def num_free_blocks(self) -> int: ...

    def prepare(self, seqs: list[SeqStep], num_heads: int) -> StepAttention: ...


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits. ``num_kv_blocks`` rBlocks in all, split evenly over ``num_partitions`` rManagers."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int = 2048
    num_partitions: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget: vLLM's CPU server default (M=512 GEMMs run slower)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # Decode steps of the local engine replay CUDA graphs (one per batch-size bucket up to
    # max_num_seqs, captured at start) on CUDA; enforce_eager turns them off (vLLM's flag). Steps with
    # remote KV (a compute instance) always run eagerly: their attention crosses the network.
    enforce_eager: bool = False
    # Run decode through the CUDA-graph path's static buffers without capturing: on CPU, to test them.
    static_decode_without_graphs: bool = False
    # Reuse the KV of full rBlocks a previous sequence computed for the same leading tokens (vLLM's
    # automatic prefix caching, on by default as there); ``--no-prefix-caching`` turns it off.
    enable_prefix_caching: bool = True
    # rBlocks a running sequence asks for beyond its need, per placement (SchedulerConfig): 0 for local
    # rManagers; a compute instance, whose placements are round trips to the global manager, sets it.
    placement_lookahead_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {self.num_partitions}")
        if self.num_kv_blocks < self.num_partitions:
            raise ValueError(f"num_kv_blocks {self.num_kv_blocks} < num_partitions {self.num_partitions}")


@dataclass
class _Request:
    seq: Sequence
    detok: object  # models.tokenizer.IncrementalDetokenizer
    stopper: TextStopper
    emitted_tokens: int = 0
    sent_prompt_logprobs: bool = False  # the prompt's log-probabilities go out once, with the first output


class LLMEngine:
    """Continuous-batching engine of one process. Not thread-safe: drive it from one thread."""

    def __init__(self, model: LlamaForCausalLM, tokenizer, config: EngineConfig, kv: KVBackend | None = None) -> None:  # noqa: ANN001
        """``kv`` says where KV lives: default ``num_partitions`` local rManagers; a compute instance passes
        its remote attention servers."""
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.config = config
        self.kv: KVBackend = kv if kv is not None else local_dist_attention(model.config, config)
        limits = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.placement_lookahead_blocks)
        self.scheduler = Scheduler(limits, self.kv)
        graphs = decode_graphs(model, self.kv, config) if kv is None else None
        prefetch = mask_prefetch_for(config.device, remote_kv=kv is not None)
        self.runner = ModelRunner(model, self.kv.prepare, config.device, graphs, prefetch)
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.num_interrupted_steps = 0
        self.last_step_scheduled = 0  # sequences the last step scheduled (0: it ran no model)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size)  # built on first use

    @classmethod
    def from_pretrained(cls, model: str | None = None, config: EngineConfig | None = None) -> LLMEngine:
        """Load a model (HF dir, GGUF file, or None for the default model) and build an engine."""
        from infinite_llm.models.registry import load_model_files, resolve_model

        config = config or EngineConfig()
        model_config, state_dict, tokenizer = load_model_files(resolve_model(model), config.dtype)
        return cls.from_weights(model_config, state_dict, tokenizer, config)

    @classmethod
    def from_weights(
        cls,
        model_config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        tokenizer,  # noqa: ANN001
        config: EngineConfig,
        kv: KVBackend | None = None,
    ) -> LLMEngine:
        """Build an engine from already loaded HF-named weights (lets tests share one load)."""
        net = LlamaForCausalLM(model_config)
        net.load_state_dict_hf(state_dict)
        net = net.to(device=config.device, dtype=config.dtype).eval()
        return cls(net, tokenizer, config, kv)

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id.

        Raises:
            InvalidRequest: empty prompt, token ids outside the vocabulary, a request id that breaks the
                rule of ``core/ids.py`` or is already in use.
            ContextLengthExceeded: prompt + ``max_tokens`` exceeds the model's maximum length.
            CapacityExhausted: the request could never fit in the engine's KV memory.
        """
        if request_id is not None:
            check_id("request_id", request_id)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        eos = () if params.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        seq = Sequence(request_id, ids, params, stop_ids=eos + params.stop_token_ids)
        if params.json_schema is not None:
            seq.constraint = self.grammars.constraint(params.json_schema)
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(seq, self.tokenizer.detokenizer(ids), TextStopper(params.stop))
        return request_id

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequest("prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        for param, token_ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            past = [t for t in token_ids if t >= vocab]  # negative ids: SamplingParams refuses them
            if past:
                raise InvalidRequest(f"{param} token id {past[0]} is outside the vocabulary [0, {vocab})", param=param)
        limit = self.model_config.max_position_embeddings
        if len(ids) + params.max_tokens > limit:
            raise ContextLengthExceeded(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's maximum "
                f"length of {limit} tokens",
                param="max_tokens",
            )

    def abort(self, request_id: str) -> RequestOutput:
        """End a request now; its rBlocks are freed. Raises ``NotFound`` for an unknown or finished id."""
        req = self._requests.get(request_id)
        if req is None:
            raise NotFound(f"no running request {request_id!r}")
        self.scheduler.finish(req.seq, "abort")
        return self._finish_output(req)

    def recompute_all(self) -> int:
        """Preempt every running sequence so it is recomputed from its tokens (e.g. KV on a dead attention
        server was lost: DESIGN.md §6). Returns how many were preempted; their outputs stay identical."""
        victims = list(self.scheduler.running)
        for seq in reversed(victims):
            self.scheduler.preempt(seq)
        return len(victims)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def clear_prefix_cache(self) -> int:
        """Uncache every rBlock (those no running request reads become free); returns how many were cached."""
        return self.kv.clear_prefix_cache() if hasattr(self.kv, "clear_prefix_cache") else 0

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- the loop ------------------------------------------------------------------------------------
    def step(self, interrupt: Interrupt | None = None) -> list[RequestOutput]:
        """Schedule, run the model once, sample, apply stop conditions. Returns one output per request
        that produced a token or finished this step, those that failed alone included (reason "error").

        ``interrupt`` is asked before each layer's attention; when it answers True the step is cut there
        (``num_interrupted_steps`` counts it) and records nothing: the caller aborts whichever request
        asked for the cut, and the next step schedules the others exactly as this one did.
        """
        out = self.scheduler.schedule()
        self.last_step_scheduled = len(out.scheduled)
        failed = [self._failed_output(seq) for seq in out.failed]
        if not out.scheduled:
            return failed
        try:
            result = self.runner.run(out.scheduled, interrupt)
        except StepInterrupted:
            self.num_interrupted_steps += 1
            return failed
        self.scheduler.mark_computed(out)
        return failed + self._process(out, result)

    def _failed_output(self, seq: Sequence) -> RequestOutput:
        """The last output of a request the scheduler failed alone (its placement was refused)."""
        final = self._finish_output(self._requests[seq.seq_id], drain=False)
        final.error = seq.error
        return final

    def _process(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        results = []
        for s in out.scheduled:
            seq = s.seq
            seq.prompt_logprobs.extend(result.prompt_logprobs.get(seq.seq_id, ()))
            if s.samples and seq.params.max_tokens == 0:  # a prompt scored without generating (echo)
                self.scheduler.finish(seq, "length")
                results.append(self._finish_output(self._requests[seq.seq_id], drain=False))
                continue
            token = result.tokens.get(seq.seq_id)
            if token is None:
                continue
            seq.output_token_ids.append(token)
            if seq.constraint is not None:
                seq.constraint.accept(token)
            if seq.params.logprobs is not None:
                seq.output_logprobs.append(result.logprobs[seq.seq_id])
            results.append(self._on_token(self._requests[seq.seq_id], token))
        return results

    def _on_token(self, req: _Request, token: int) -> RequestOutput:
        seq, p = req.seq, req.seq.params
        below_min = len(seq.output_token_ids) < p.min_tokens  # stop strings wait for min_tokens (vLLM)
        is_eos = not p.ignore_eos and token in self.tokenizer.eos_token_ids
        reason = "stop" if is_eos or token in p.stop_token_ids else None
        text, stopped = ("", False) if reason else req.stopper.push(req.detok.push(token), check=not below_min)
        if stopped:
            reason = "stop"
        elif reason is None and len(seq.output_token_ids) >= p.max_tokens:
            reason = "length"
        if reason is None:
            return self._delta(req, text)
        self.scheduler.finish(seq, reason)
        return self._finish_output(req, text, drain=not stopped)

    def _delta(self, req: _Request, text: str, finished: bool = False) -> RequestOutput:
        seq = req.seq
        new_ids = seq.output_token_ids[req.emitted_tokens :]
        new_logprobs = seq.output_logprobs[req.emitted_tokens :] if seq.params.logprobs is not None else None
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and not req.sent_prompt_logprobs:
            prompt_logprobs, req.sent_prompt_logprobs = [None, *seq.prompt_logprobs], True
        req.emitted_tokens = len(seq.output_token_ids)
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=new_ids,
            new_text=text,
            token_ids=list(seq.output_token_ids),
            text=req.stopper.emitted_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_preemptions=seq.num_preemptions,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            new_logprobs=new_logprobs,
            logprobs=list(seq.output_logprobs) if new_logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _finish_output(self, req: _Request, text: str = "", drain: bool = True) -> RequestOutput:
        """Final output: the detokenizer's pending bytes (unless a stop string already cut the text), then
        whatever the stopper held back."""
        del self._requests[req.seq.seq_id]
        if drain:
            tail, _ = req.stopper.push(req.detok.flush())
            text += tail
        return self._delta(req, text + req.stopper.flush(), finished=True)

    # ---- drivers -------------------------------------------------------------------------------------
    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion together; returns final outputs in prompt order (one that failed
        alone has finish reason "error" and its ``error``)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(pr, pa) for pr, pa in zip(prompts, plist, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Yield this request's deltas as they are produced (other queued requests advance too)."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for o in self.step():
                    if o.request_id == rid and o.error is not None:
                        raise o.error
                    if o.request_id == rid:
                        yield o
                        if o.finished:
                            return
        finally:
            if rid in self._requests:
                self.abort(rid)


def decode_graphs(model: LlamaForCausalLM, kv: DistAttention, config: EngineConfig) -> DecodeGraphs | None:
    """The decode path of a local engine: CUDA graphs on CUDA unless ``enforce_eager``; the same static
    buffers run eagerly if ``static_decode_without_graphs``; else ``None`` (every step eager).

    Capture needs the Triton kernels (the torch reference reads tensors on the host): on CUDA without
    triton the engine runs eagerly.
    """
    from infinite_llm.kernels import merge_partials, use_triton

    device = torch.device(config.device)
    capture = device.type == "cuda" and not config.enforce_eager and use_triton(device)
    if not capture and not config.static_decode_without_graphs:
        return None
    assert isinstance(kv.transport, LocalTransport)

    max_len = model.config.max_position_embeddings
    return DecodeGraphs(model, kv, kv.transport.holders, config.max_num_seqs, max_len, capture, merge_partials)


def local_dist_attention(model: ModelConfig, config: EngineConfig) -> DistAttention:
    """DistAttention over ``config.num_partitions`` in-process rManagers on ``config.device``."""
    from infinite_llm.kernels import merge_partials, partial_attention, write_kv  # Triton on CUDA, torch elsewhere

    assert model.head_dim is not None
    layout = KVLayout(
        model.num_hidden_layers, config.block_size, model.num_key_value_heads, model.head_dim, config.dtype
    )
    base, extra = divmod(config.num_kv_blocks, config.num_partitions)
    holders = {
        partition_id(p): RManager(
            base + (p < extra), layout, config.device, attention_impl=partial_attention, write_kv_impl=write_kv
        )
        for p in range(config.num_partitions)
    }
    model_id = LOCAL_MODEL_ID if config.enable_prefix_caching else None
    return DistAttention(
        LocalPlacement(holders), LocalTransport(holders), config.block_size, config.device, merge_partials, model_id
    )
