"""Regenerate the committed Python stubs beside the .proto files: python scripts/gen_proto.py [OUT_DIR]."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto under proto/ into out_dir (same relative layout); returns the sources."""
    sources = sorted(PROTO_ROOT.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    for source in sources:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(source.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {source}")
    return sources


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
