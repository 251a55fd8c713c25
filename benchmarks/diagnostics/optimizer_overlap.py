"""Could the optimizer's step hide behind the next step's forward? A timing experiment on one GPU, no feature.

    torchrun --nproc_per_node=1 benchmarks/diagnostics/optimizer_overlap.py [--recipe recipes/k3_small.yaml]
        [--steps 5] [--windows 3] [--main-priority default|high] [--out FILE] [key=value ...]

The recipe's trainer at one rank (parallel.ep=1 added) trains --steps steps pipelined as Trainer.fit runs them,
in 2 x --windows windows that alternate: "serial", the trainer as it is, and "overlapped", where
optimizer.step() (the write-back AdamW, at the recipe's bf16 moments ~22 bytes a parameter: ~22 ms a step of
k3_small on an H200) is queued on a second stream of the same priority and the default stream waits for it only at
the end of the next forward, before the backward that accumulates into the grads it reads. The step time is
the window's wall time over its steps (the device synchronised at both ends); "hidden" is serial - overlapped.

Values are not checked: the next forward reads the bf16 compute copies while the step writes them (a real
implementation would make each layer's forward wait for that layer's write-back); at optim.lr=1e-10 (bench_train's
speed points' rate: the weights stay put; gpu_checks.sh overlap passes it) the race changes nothing. What the
windows measure is whether the GPU finds room for the step's memory-bound kernels among the pass's: the gaps where
the host is behind and the kernels that leave SMs free can take them, the GEMMs that fill every SM cannot.
--main-priority high runs the whole trainer on a high-priority stream (both kinds of window), so that the pass's
blocks go first wherever both streams have work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.diagnostics.one_rank import on_one_gpu, one_rank_trainer, recipe_parser
from moontrain.trainer.trainer import Trainer


class Overlap:
    """optimizer.step() on a side stream while `on`; the model's forward ends with the wait for it."""

    def __init__(self, trainer: Trainer) -> None:
        self.on = False
        self.side = torch.cuda.Stream(trainer.layout.device)
        self.done: torch.cuda.Event | None = None
        self.held: list[torch.Tensor | None] = []
        self.optimizer = trainer.optimizer
        self._step, self._forward = trainer.optimizer.step, trainer.model.forward
        trainer.optimizer.step = self.step
        trainer.model.forward = self.forward

    def step(self, *args: object, **kwargs: object) -> object:
        if not self.on:
            return self._step(*args, **kwargs)
        self.side.wait_stream(torch.cuda.current_stream())  # the clip factor, the verdict, the grads
        # what the step reads was made on the caller's stream, and the host lets go of some of it when step()
        # returns (the clip factor, the skip flag): held until the wait, or the caller's stream would reuse it
        opt = self.optimizer
        self.held = [getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None),
                     *(p.grad for group in opt.param_groups for p in group["params"])]
        with torch.cuda.stream(self.side):
            out = self._step(*args, **kwargs)
            self.done = torch.cuda.Event()
            self.done.record(self.side)
        return out

    def forward(self, *args: object, **kwargs: object) -> object:
        out = self._forward(*args, **kwargs)
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)
            self.done, self.held = None, []
        return out


def window_ms(trainer: Trainer, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    trainer.run_steps(steps)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def main() -> None:
    p = recipe_parser(__doc__)
    p.add_argument("--steps", type=int, default=5, help="steps a window")
    p.add_argument("--windows", type=int, default=3, help="windows of each kind, alternating")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, caches)")
    p.add_argument("--main-priority", choices=["default", "high"], default="default")
    p.add_argument("--out", default=None, help="JSON path (none: the table only)")
    args = p.parse_args()
    on_one_gpu("optimizer_overlap.py", lambda device: run(args, device))


def run(args: argparse.Namespace, device: torch.device) -> None:
    stream = torch.cuda.Stream(device, priority=-1) if args.main_priority == "high" else None
    with torch.cuda.stream(stream):
        timed_windows(args, device)


def timed_windows(args: argparse.Namespace, device: torch.device) -> None:
    trainer = one_rank_trainer(args.recipe, args.overrides, args.warmup + 2 * args.windows * args.steps + 1, device)
    overlap = Overlap(trainer)
    trainer.run_steps(args.warmup)
    times: dict[str, list[float]] = {"serial": [], "overlapped": []}
    for _ in range(args.windows):
        for kind in times:
            overlap.on = kind == "overlapped"
            times[kind].append(window_ms(trainer, args.steps))
    overlap.on = False
    med = {kind: statistics.median(t) for kind, t in times.items()}
    print(f"{args.recipe} {' '.join(args.overrides)}; {torch.cuda.get_device_name(device)}; main stream "
          f"{args.main_priority} priority; {args.steps} steps a window")
    print(f"{'window':<12}{'median ms':>11}  each window's ms a step")
    for kind, t in times.items():
        print(f"{kind:<12}{med[kind]:>11.1f}  {', '.join(f'{x:.1f}' for x in t)}")
    print(f"hidden {med['serial'] - med['overlapped']:.1f} ms a step")
    if args.out:
        Path(args.out).write_text(json.dumps({"recipe": args.recipe, "overrides": args.overrides,
                                              "device": torch.cuda.get_device_name(device),
                                              "main_priority": args.main_priority, "steps": args.steps,
                                              "ms_a_step": times, "median": med}, indent=1))
    trainer.close()


if __name__ == "__main__":
    main()
