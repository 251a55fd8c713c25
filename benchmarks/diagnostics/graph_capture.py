"""Could a training pass be replayed from a CUDA graph? A diagnostic on one GPU, no feature.

    torchrun --nproc_per_node=1 benchmarks/diagnostics/graph_capture.py [--recipe recipes/k3_small.yaml]
        [--warmup 3] [--replays 10] [--out FILE] [key=value ...]

The recipe's trainer at one rank (parallel.ep=1 added) trains --warmup steps (torch.compile, the autotuners, the
warm-up), then takes one micro-batch of the next step and runs its pass (forward and backward, no optimizer):

1. syncs: one eager pass under torch.cuda's sync debug mode "warn". Every host sync it makes is listed with the
   frames of this project's and fla's code that made it (a sync cannot be captured; a backward sync is reported
   after the backward, with no frames of its own);
2. capture: two passes on a side stream, then the pass captured with torch.cuda.graph. A capture that fails
   prints its error and the project frames it came through;
3. replay: where the capture held, the pass's wall time eager (timed before the capture) against a replay of the
   graph (median of --replays each, the device synchronised around each pass), and the replay's loss against the
   eager pass's on the same batch and weights (equal: the graph runs the same kernels on the same inputs).

The idle time this would remove: the recipe's H100 profile has ~5.6 % of the step with no kernel running
(docs/performance.md); a replay launches the pass's kernels without the host between them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.diagnostics.one_rank import on_one_gpu, one_rank_trainer, recipe_parser

OURS = ("/moontrain/", "/moonep/", "/fla/")


def our_frames(frames: list[traceback.FrameSummary]) -> str:
    """The innermost frames in this project's or fla's code, innermost last."""
    mine = [f for f in frames if any(k in f.filename for k in OURS) and "/diagnostics/" not in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(mine[-4:])) or "(no frame)"


def find_syncs(run_pass) -> Counter:
    """Each distinct sync site of one eager pass, counted (the mode's own notice that it is a prototype aside)."""
    sites: Counter = Counter()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if "synchronizing" not in text.lower():
            show(message, category, filename, lineno, file, line)
        elif "prototype feature" not in text:
            sites[f"{text.splitlines()[0][:90]} at {our_frames(traceback.extract_stack()[:-1])}"] += 1

    with warnings.catch_warnings():  # restores showwarning and the filters on leaving
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_pass()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    return sites


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    p = recipe_parser(__doc__)
    p.add_argument("--warmup", type=int, default=3, help="steps trained first (compile, autotune)")
    p.add_argument("--replays", type=int, default=10, help="timed passes of each kind")
    p.add_argument("--out", default=None, help="JSON path (none: the printout only)")
    args = p.parse_args()
    on_one_gpu("graph_capture.py", lambda device: run(args, device))


def run(args: argparse.Namespace, device: torch.device) -> None:
    trainer = one_rank_trainer(args.recipe, args.overrides, args.warmup + 1, device)
    trainer.run_steps(args.warmup)
    tokens, targets = trainer.data.batch(trainer.step)
    n = trainer.accumulation_steps
    tokens, targets, host = tokens.chunk(n)[0], targets.chunk(n)[0], trainer.data.host_tokens.chunk(n)[0]
    params = [*trainer.model.parameters(), *(trainer.plain_dense.compute if trainer.plain_dense is not None else [])]

    def run_pass() -> torch.Tensor:
        for q in params:
            q.grad = None
        loss, _ = trainer.model(tokens, targets, host_tokens_BT=host)
        loss.backward()
        return loss.detach()

    result: dict = {"recipe": args.recipe, "overrides": args.overrides, "device": torch.cuda.get_device_name(device),
                    "tokens": tokens.numel()}
    print(f"{args.recipe} {' '.join(args.overrides)}; {result['device']}; a pass of {tokens.numel()} tokens")
    sites = find_syncs(run_pass)
    result["syncs"] = dict(sites)
    print(f"1. syncs in one eager pass: {sum(sites.values())} at {len(sites)} sites")
    for site, count in sites.most_common():
        print(f"   {count:>3} x {site}")
    eager = timed(run_pass, args.replays)  # before the capture: moonep's stream state then holds captured events
    result["eager_ms"] = eager  # kept whether or not the capture holds
    eager_loss = run_pass()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run_pass()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the graph's pool is its own: the eager passes' cached blocks go back to the device
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            graph_loss = run_pass()
    except Exception as err:  # the diagnostic's answer: what stops a capture
        frames = traceback.extract_tb(err.__traceback__)
        result["capture"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]} at {our_frames(frames)}"
        print(f"2. capture failed: {result['capture']}")
    else:
        result["capture"] = "ok"
        graph.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(graph_loss, eager_loss))
        replay = timed(graph.replay, args.replays)
        result.update(loss_equal=same, replay_ms=replay)
        print(f"2. capture ok; replay loss {graph_loss.item():.6f} vs eager {eager_loss.item():.6f} "
              f"({'equal' if same else 'NOT equal'})")
        print(f"3. pass ms (median of {args.replays}): eager {statistics.median(eager):.1f}, replay "
              f"{statistics.median(replay):.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    trainer.close()


if __name__ == "__main__":
    main()
