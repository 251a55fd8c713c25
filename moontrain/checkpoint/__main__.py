"""`python -m moontrain.checkpoint export CHECKPOINT_DIR OUT_DIR [...]`: the same as `moontrain export`."""

from __future__ import annotations

import sys

from moontrain.cli import export_command


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "export":
        print("usage: python -m moontrain.checkpoint export CHECKPOINT_DIR OUT_DIR [--dtype ...]", file=sys.stderr)
        return 2
    return export_command(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
