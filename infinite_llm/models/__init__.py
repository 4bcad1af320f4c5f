"""Checkpoint loading, tokenizer and model registry.

``registry`` resolves a model name or path and loads it; ``hf`` reads HF safetensors checkpoints,
``gguf_loader`` reads GGUF files (dequantized to float), ``tokenizer`` wraps an HF tokenizer with a streaming
detokenizer, ``checkpoint`` states the state-dict contract. Everything here produces the plain inputs of
``core/``: a :class:`~infinite_llm.core.config.ModelConfig` and a state dict with HF Llama parameter names.
"""
