"""The main job's (``make run``) bad input: one line on stderr and exit 2, before any mesh starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infinite_llm import main_job
from infinite_llm.models.registry import load_model_config, resolve_model


def bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the job in process with ``argv``; assert exit 2, nothing on stdout, one line on stderr; return it."""
    assert main_job.main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def test_a_missing_document_is_named(capsys, tmp_path: Path):
    missing = tmp_path / "nowhere.txt"
    assert bad(capsys, "--doc", str(missing)) == f"error: --doc {missing}: no such file"


def test_a_directory_is_not_a_document(capsys, tmp_path: Path):
    assert bad(capsys, "--doc", str(tmp_path)) == f"error: --doc {tmp_path}: is a directory, not a file"


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_a_binary_file_is_not_utf8_text(capsys, tmp_path: Path, bom: bytes):
    doc = tmp_path / "image.bin"
    doc.write_bytes(bom + b"PNG header \x89\xff\xfe and more")
    byte = 11 + len(bom)  # the file's offset, a byte order mark counted
    assert bad(capsys, "--doc", str(doc)) == f"error: --doc {doc}: not UTF-8 text (byte {byte} cannot be decoded)"


@pytest.mark.parametrize("content", [b" \n\t\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf \n"])  # blank, a lone byte order mark
def test_an_empty_document_is_refused(capsys, tmp_path: Path, content: bytes):
    doc = tmp_path / "blank.txt"
    doc.write_bytes(content)
    assert bad(capsys, "--doc", str(doc)) == f"error: --doc {doc}: the document is empty"


@pytest.mark.parametrize(
    ("flag", "value"), [("--max-tokens", "0"), ("--attention-servers", "0"), ("--block-size", "-16")]
)
def test_counts_below_one_are_refused(capsys, flag: str, value: str):
    assert bad(capsys, flag, value) == f"error: {flag} must be at least 1, got {value}"


def test_an_empty_question_is_refused(capsys):
    assert bad(capsys, "--question", "  ") == "error: --question is empty"


def test_a_document_longer_than_the_context_is_refused_before_the_mesh_starts(capsys, tmp_path, default_model_path):
    context = load_model_config(resolve_model(None)).max_position_embeddings
    doc = tmp_path / "long.txt"
    doc.write_text("The quick brown fox jumps over the lazy dog. " * (context // 8), encoding="utf-8")
    line = bad(capsys, "--doc", str(doc), "--max-tokens", "10")
    assert line.startswith(f"error: --doc {doc}: ") and line.endswith(
        f"prompt tokens + --max-tokens 10 exceed the model's context of {context} tokens; use a shorter document"
    )
    prompt_tokens = int(line.split(": ")[2].split()[0])
    assert prompt_tokens + 10 > context


def test_a_real_process_exits_2_with_one_line_and_no_traceback(tmp_path: Path):
    missing = tmp_path / "nowhere.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "infinite_llm.main_job", "--doc", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"error: --doc {missing}: no such file\n"
