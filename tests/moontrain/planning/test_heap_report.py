"""The dry run prints moonep's symmetric heap region by region, equal to moonep.Layout's sizes and to the sizes
derived by hand here (no slot or reduce pool at EP = 1, B = epn rows at EP = 2, no combine rows with the recipe's destination
combine), and the allocator's share of
the estimate (its total less the heap). Model: k3_small_moe as the DSV3 block of issue 35 (E = 96 at EP = 1,
the recipe's E = 192 at EP = 2: 96 local experts of 2048 x 1024 in either case, 7 MoE layers, bf16)."""

from __future__ import annotations

import pytest

from moonep import BufferConfig, BufferOptions, Layout
from moontrain.cli import main
from moontrain.planning.report import _bytes

DSV3 = ["model.attn_output_gate=false", "model.moe_latent_size=null", "model.kda_layers_per_mla=0",
        "model.use_nope=false", "train.micro_batch_size=8", "parallel.compute_dtype=bfloat16"]
EXPERT = 3 * 2048 * 1024  # elements of one expert over gate, up and down
S, K = 8 * 4096, 8  # tokens per rank per pass, top-k


def _heap_rows(out: str) -> dict[str, str]:
    lines = out.split("== symmetric heap per rank")[1].split("== checks ==")[0].splitlines()[1:]
    return {line[2:18].strip(): line[19:31].strip() for line in lines}  # "  {name:<16} {bytes:>12}   {role}"


@pytest.mark.parametrize(("ep", "overrides", "slots"), [(1, ["model.num_experts=96", "parallel.dense=plain"], 0),
                                                         (2, [], 96)])
def test_dry_run_prints_the_heap(ep: int, overrides: list[str], slots: int, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["launch", "recipes/k3_small_moe.yaml", *DSV3, *overrides, f"parallel.ep={ep}", "--nproc", str(ep),
            "--dry-run", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _heap_rows(out)
    # the recipe sums at the destination: no combine rows in the comm segment
    layout = Layout(BufferConfig(max_tokens=S, hidden=2048, topk=K, num_experts=96 * ep, token_padding=16,
                                 options=BufferOptions(combine_reduce="destination")), ep)
    assert "comb" not in layout.comm and "land" in layout.comm
    want = {"comm": layout.comm_bytes, "weights": 7 * 96 * EXPERT * 2, "grads": 7 * 96 * EXPERT * 4,
            "slot_pool": slots * EXPERT * 2, "reduce_pool": slots * EXPERT * 4}
    assert want == layout.heap_bytes({"gate": (2048, 1024), "up": (2048, 1024), "down": (1024, 2048)}, 7)
    # NvS by hand: S*K rows and 96 (one rank) or 192 (two ranks) groups padded by up to 15 rows
    assert layout.nvs == S * K + (96 if ep == 1 else 192) * 15
    assert {name: rows[name] for name in want} == {name: _bytes(n) for name, n in want.items()}
    assert rows["heap total"] == _bytes(sum(want.values()))
    assert f"B={slots} prefetch slots" in out and f"(moonep, outside the PyTorch allocator; B={slots})" in out
    total = float(out.split("  total ")[1].split("GiB")[0]) * 2**30
    allocator = float(rows["allocator"].split()[0]) * 2**30
    assert abs(total - sum(want.values()) - allocator) < 0.02 * 2**30  # two roundings to 0.01 GiB
