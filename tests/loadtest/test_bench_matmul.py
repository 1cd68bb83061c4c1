"""``python -m loadtest.kernels.matmul``: the matmul benchmark runs its kernels, checks them, prints a
row per row count, and refuses bad arguments."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from loadtest.kernels import matmul as bench_matmul


def test_prints_a_line_per_row_count_with_ratios(capsys):
    assert bench_matmul.main(["--kernels", "numba,onednn,torch", "--rows", "1,7", "--rounds", "2",
                              "--layers", "1", "--vocab", "100", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "onednn/numba" in out and "torch/numba" in out
    for kernel in ("numba", "onednn", "torch"):
        err = float(re.search(rf"{kernel}: ready, relative error vs float64 (\S+)", out).group(1))
        assert 0 < err <= 2 ** -6
    lines = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s+(\d+) \| (.*)$", out, re.M)}
    assert sorted(lines) == [1, 7]
    for cells in lines.values():
        times, ratios, speeds = (part.split() for part in cells.split("|"))
        assert len(times) == 3 and len(ratios) == 2 and len(speeds) == 3
        assert all(float(v) > 0 for v in times + ratios + speeds)
        # the ratio column is the time column's quotient (as printed, to rounding)
        assert float(ratios[0]) == pytest.approx(float(times[1]) / float(times[0]), rel=0.02, abs=0.01)
    # weight bytes: one layer of SmolLM2's seven matmuls plus a 100-row head, bfloat16
    per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536
    assert bench_matmul.weight_bytes(1, 100, torch.bfloat16) == 2 * (per_layer + 576 * 100)
    assert f"{2 * (per_layer + 57600) / 1e6:.0f} MB of weights" in out


class _Wrong(nn.Module):
    """A kernel that multiplies by the wrong weight: the check must catch it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.linear = linear

    def forward(self, x):
        return self.linear(x) * 1.1


def test_check_refuses_a_wrong_kernel(monkeypatch):
    linears, head = bench_matmul.make_linears(1, 64, torch.bfloat16)
    chain = bench_matmul.Chain("torch", linears, head)
    assert bench_matmul.check(chain, linears[0][-1], torch.bfloat16) <= 2 ** -6
    monkeypatch.setattr(bench_matmul, "wrapper", lambda kernel: _Wrong)
    wrong = bench_matmul.Chain("torch", linears, head)
    with pytest.raises(RuntimeError, match="relative error"):
        bench_matmul.check(wrong, linears[0][-1], torch.bfloat16)


@pytest.mark.parametrize("args", [
    ["--kernels", "numba,cublas"], ["--kernels", "numba,numba"], ["--kernels", ""],
    ["--rows", "0"], ["--rows", "a,b"], ["--rounds", "0"], ["--layers", "0"],
    ["--dtype", "float32", "--kernels", "numba"],
])
def test_bad_arguments_are_refused(args, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_matmul.main(args)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
