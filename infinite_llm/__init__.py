"""Infinite-LLM: distributed serving for long-context LLMs."""
