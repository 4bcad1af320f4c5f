"""The main job's answer step (what `make run` prints) on the session mesh: the streamed answer is HF's greedy
text for the same prompt, and the table says where its rBlocks lived and how many tokens they hold."""

from __future__ import annotations

import argparse

from infinite_llm import main_job
from tests.e2e.test_gateway_logprobs import hf_greedy

TEXT = "The lighthouse on the northern cape was painted red and white in 1921 and has guided ships ever since."
QUESTION = "What colours is the lighthouse painted?"
MAX_TOKENS = 8


def test_the_answer_is_hfs_greedy_text_and_the_table_counts_the_tokens_held(mesh, tokenizer, hf_model, capsys):
    ids = main_job.build_prompt(tokenizer, TEXT, QUESTION)
    args = argparse.Namespace(question=QUESTION, max_tokens=MAX_TOKENS, block_size=mesh.config.block_size)
    assert main_job.ask(mesh, ids, args, len(ids)) == 0
    out = " ".join(capsys.readouterr().out.split())
    new = hf_greedy(hf_model, ids, MAX_TOKENS)
    answer = " ".join(tokenizer.decode(new, skip_special_tokens=True).split())
    assert answer and f"A: {answer}" in out, out
    assert f"{len(ids) + len(new)} tokens held in all; an rBlock holds {mesh.config.block_size}" in out, out
    assert f"{len(new)} new tokens, the {len(new) - 1} after the first in" in out, out
