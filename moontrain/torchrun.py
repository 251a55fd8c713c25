"""torchrun as `moontrain launch` runs it: `python -m moontrain.torchrun [torchrun options] ...`.

The same as `python -m torch.distributed.run`, except for its failure report: when a worker has reported
its own error (the file named by MOONTRAIN_ERROR_FILE exists: moontrain.trainer.worker), torchrun exits 1
without printing its ChildFailedError traceback and box, which would only repeat, less clearly, what the
worker said. The launcher then forwards every line the ranks wrote (their tracebacks included) and prints
the worker's line last. A worker that died without a word (a signal, a crash) still gets torchrun's report.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except ChildFailedError:
        error_file = os.environ.get("MOONTRAIN_ERROR_FILE")
        if not (error_file and os.path.exists(error_file)):
            raise
        sys.exit(1)
