"""`python -m moontrain.checkpoint export CHECKPOINT_DIR OUT_DIR`: write a Hugging-Face-style model directory."""

from __future__ import annotations

import sys

from moontrain.checkpoint.hf import export_hf


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "export":
        print("usage: python -m moontrain.checkpoint export CHECKPOINT_DIR OUT_DIR", file=sys.stderr)
        return 2
    print(export_hf(argv[1], argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
