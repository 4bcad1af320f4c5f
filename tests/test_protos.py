"""The checked-in generated gRPC code matches the .proto sources (``make proto`` was run)."""

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_not_stale(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "protos/generate.py"), "--out", str(tmp_path)], check=True, capture_output=True
    )
    fresh = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".py", ".pyi"))
    committed = sorted(p.name for p in (ROOT / "infinite_llm/pb/v1").iterdir() if p.suffix in (".py", ".pyi"))
    assert fresh == committed
    _, mismatch, errors = filecmp.cmpfiles(tmp_path, ROOT / "infinite_llm/pb/v1", fresh, shallow=False)
    assert mismatch == [] and errors == [], f"stale generated code: {mismatch or errors}; run `make proto`"
