"""Which errors a worker reports as one line (the user's to fix) and which keep their traceback (ours).

One line: ValueError (a bad setting, named with its fix), CheckpointError, DivergenceError, a step out of GPU
memory (moontrain.trainer.out_of_memory: where, and the settings that fit by the estimate), and any
exception raised while reading the training data (raised from a frame in moontrain.data or the
libraries it reads with: an empty corpus, a null text value, an unreadable file), which is reported
with the data settings to check. Everything else is a bug or a system fault and keeps its traceback.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from moontrain.checkpoint.tensors import CheckpointError
from moontrain.data.config import DataConfig
from moontrain.trainer.guard import DivergenceError
from moontrain.trainer.out_of_memory import TrainingOutOfMemory

_DATA_DIR = Path(__file__).resolve().parents[1] / "data"
_DATA_LIBRARIES = ("/datasets/", "/pyarrow/", "/tokenizers/")


def _from_data(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of moontrain.data in err's traceback, when the error came from data reading."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(_DATA_DIR)]
    if not ours:
        return None
    after = frames[frames.index(ours[-1]) + 1:]  # below the last data frame: only data libraries or builtins
    if any("/moontrain/" in f.filename for f in after):
        return None
    return ours[-1]


def one_line(err: BaseException, data: DataConfig) -> str | None:
    """The one-line report of a user error, or None when the traceback should be shown."""
    if isinstance(err, (ValueError, CheckpointError, DivergenceError, TrainingOutOfMemory)):
        return f"error: {err}"
    frame = _from_data(err)
    if frame is None:
        return None
    what = str(err).splitlines()[0] if str(err) else ""
    kind = type(err.__cause__) if isinstance(err.__cause__, StopIteration) else type(err)  # PEP 479 wraps it
    cause = {StopIteration: "no documents (an empty corpus?)",
             AttributeError: "a document without text (a null value in the text column?)"}.get(kind, "")
    return (f"error: reading the training data failed: {type(err).__name__}{': ' + what if what else ''}"
            f"{' - ' + cause if cause else ''} (at {Path(frame.filename).name}:{frame.lineno}); check data.path="
            f"{data.path!r}, data.format={data.format}, data.text_field={data.text_field!r}")
