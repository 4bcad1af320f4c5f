"""lm-eval 0.4.13 (``local-completions``) against the real gateway of a local mesh, on two tiny tasks the
test writes itself (nothing is downloaded): a multiple-choice task (loglikelihoods: ``echo`` + ``logprobs``)
and a ``generate_until`` task. The per-choice loglikelihoods lm-eval logs agree with HF transformers'
log-softmax on the same weights within 1e-3, so both pick the same answers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from infinite_llm.models.registry import load_tokenizer, resolve_model
from tests.e2e.conftest import API_KEY

# lm-eval's dependencies clash with the project's (its table writer caps python-dateutil below 3, the
# Kubernetes client needs 3 or later): it runs from its own virtual environment, made by `make lm-eval-venv`.
LM_EVAL = Path(__file__).resolve().parents[2] / ".venv-lm-eval" / "bin" / "lm_eval"
# Set to 1 where lm-eval's virtual environment cannot be built (no registry): the test skips, saying so.
SKIP_ENV = "INFINITE_LLM_TESTS_SKIP_LM_EVAL"
QUESTIONS = [
    {"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "purple"], "answer": 0},
    {"question": "How many legs does a cat have?", "choices": ["two", "four", "eight"], "answer": 1},
    {"question": "Which animal barks?", "choices": ["a fish", "a bird", "a dog"], "answer": 2},
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
]
MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def write_tasks(tmp_path) -> None:
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "tiny_mc.yaml").write_text(MC_TASK.format(data=data))
    (tmp_path / "tiny_gen.yaml").write_text(GEN_TASK.format(data=data))


def hf_loglikelihood(hf_model, tokenizer, context: str, continuation: str) -> float:
    """lm-eval's split (whole text encoded, the context's tokens cut off) scored by HF in fp32."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logits = hf_model(torch.tensor([whole])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(whole[1:])[:, None])[:, 0]
    return lp[n_ctx - 1 :].sum().item()


def run_lm_eval(gateway: str, tmp_path: Path) -> Path:
    """lm-eval's CLI from its own virtual environment over both tasks; returns its output directory."""
    tokenizer = load_tokenizer(resolve_model(None))
    tokenizer.save(tmp_path / "tokenizer")
    write_tasks(tmp_path)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    served = httpx.get(f"http://{gateway}/v1/models", headers=headers, trust_env=False).json()["data"][0]["id"]
    model_args = (
        f"model={served},base_url=http://{gateway}/v1/completions,tokenizer={tmp_path / 'tokenizer'},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    )
    cmd = [str(LM_EVAL), "--model", "local-completions", "--model_args", model_args, "--tasks", "tiny_mc,tiny_gen"]
    cmd += ["--include_path", str(tmp_path), "--log_samples", "--output_path", str(tmp_path / "out")]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets-cache")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return tmp_path / "out"


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_lm_eval_multiple_choice_and_generate_until_through_the_gateway(mesh, hf_model, tmp_path):
    if not LM_EVAL.exists():  # `make test` builds it: missing means a broken install, not a skip
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(f"{LM_EVAL} is missing and {SKIP_ENV}=1")
        pytest.fail(f"{LM_EVAL} is missing: `make lm-eval-venv` makes it (or set {SKIP_ENV}=1 to skip)")
    out = run_lm_eval(mesh.gateway_address, tmp_path)
    tokenizer = load_tokenizer(resolve_model(None))
    mc = samples(out, "tiny_mc")
    assert len(mc) == len(QUESTIONS)
    for sample in mc:
        doc, context = sample["doc"], f"Question: {sample['doc']['question']}\nAnswer:"
        ours = [float(resp[0][0]) for resp in sample["resps"]]  # (loglikelihood, is_greedy) per choice, as text
        ref = [hf_loglikelihood(hf_model, tokenizer.hf, context, " " + c) for c in doc["choices"]]
        assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-3
        assert ours.index(max(ours)) == ref.index(max(ref))
    gen = samples(out, "tiny_gen")
    assert len(gen) == len(QUESTIONS)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for sample in gen:  # greedy: the text the gateway itself gives the same prompt, cut at the stop string
        body = {"prompt": sample["arguments"]["gen_args_0"]["arg_0"], "max_tokens": 8, "temperature": 0, "stop": ["\n"]}
        r = httpx.post(f"http://{mesh.gateway_address}/v1/completions", json=body, headers=headers, trust_env=False)
        assert sample["resps"][0][0] == r.json()["choices"][0]["text"]
