"""Generate the Python code of ``protos/infinite_llm/v1/*.proto`` into ``infinite_llm/pb/v1/``.

Layout choice: the .proto sources mirror their proto package (``infinite_llm.v1``, imported as
``infinite_llm/v1/tensor.proto`` with ``-Iprotos``), so descriptors, reflection and tools such as grpcurl
(``-import-path protos``) see the same paths. protoc names the generated modules after those paths
(``infinite_llm.v1.tensor_pb2``); the package ships them under ``infinite_llm.pb.v1``, so this script runs
protoc into a scratch directory and rewrites the one import form protoc emits between our files
(``from infinite_llm.v1 import x_pb2``) to ``from infinite_llm.pb.v1 import x_pb2``. Nothing else changes.

``make proto`` runs it in place; ``make proto-check`` runs it with ``--out`` into a temporary directory and
diffs against the committed code, so stale generated code fails the check.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_PACKAGE_DIR = Path("infinite_llm/v1")
DEFAULT_OUT = ROOT / "infinite_llm/pb/v1"
_IMPORT = re.compile(r"^from infinite_llm\.v1 import ", re.MULTILINE)
_GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def run_protoc(out_dir: Path) -> None:
    """protoc + grpc plugin over every proto of the package; output under ``out_dir/infinite_llm/v1``."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE_DIR}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generate(out: Path) -> list[Path]:
    """Regenerate every module into ``out`` (stale generated files there are removed); returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    for pattern in _GENERATED:
        for old in out.glob(pattern):
            old.unlink()
    written = []
    with tempfile.TemporaryDirectory() as scratch:
        run_protoc(Path(scratch))
        for src in sorted((Path(scratch) / PROTO_PACKAGE_DIR).iterdir()):
            dst = out / src.name
            dst.write_text(_IMPORT.sub("from infinite_llm.pb.v1 import ", src.read_text()))
            written.append(dst)
    init = out / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf and gRPC modules of the infinite_llm.v1 protos (make proto)."""\n')
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
