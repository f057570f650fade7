"""Generate the committed gRPC/protobuf stubs from ``protocol/*.proto``.

Run ``make proto`` (or ``python -m protocol.protogen``) after editing a ``.proto`` file;
``tests/unit/test_proto_stubs.py`` regenerates into a temporary folder and fails while the
committed stubs are stale.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent
# Lines that only record which generator version wrote a file: not part of freshness.
_VERSION_STAMPS = ("# Protobuf Python Version:", "GRPC_GENERATED_VERSION =")


def proto_files() -> list[Path]:
    """The ``.proto`` sources, sorted."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Compile every proto file into ``out_root/protocol/``; return the files written."""
    from grpc_tools import protoc  # heavy; only needed here

    out_dir = out_root / "protocol"
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    for proto in proto_files():
        rel = proto.relative_to(REPO_ROOT).as_posix()
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            rel,
        ]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed on {rel} (exit {code})")
    return sorted(p for p in out_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def normalized(text: str) -> str:
    """File text without generator-version stamps (compared for freshness)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(_VERSION_STAMPS))


def main() -> int:
    """Regenerate the stubs in place."""
    written = generate(REPO_ROOT)
    for path in written:
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
