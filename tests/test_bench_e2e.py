"""The end-to-end bench's planning and tables (`tools/bench_e2e.py`), on a synthetic run: which cells and engines it
plans, and that the tables divide by CPU_ATTN's figures of the same model, dtype and cell. No vLLM engine starts here
(the bench itself is minutes per engine); no speed is checked."""

from __future__ import annotations

import argparse

import pytest

from tools import bench_e2e


def test_parse_cell_reads_context_x_batch_and_rejects_the_rest() -> None:
    assert bench_e2e.parse_cell("8192x8") == (8192, 8)
    with pytest.raises(argparse.ArgumentTypeError, match="CONTEXTxBATCH"):
        bench_e2e.parse_cell("8192")
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        bench_e2e.parse_cell("0x8")


def test_a_batch_one_decode_cell_also_gives_its_prompt_length_ttft() -> None:
    cells = bench_e2e.plan_cells([(4096, 1), (4096, 8), (8192, 1)], [2048, 4096, 7168], 8)
    assert [(c.context, c.batch, c.new_tokens) for c in cells] == [
        (2048, 1, 0), (4096, 1, 8), (7168, 1, 0), (8192, 1, 8), (4096, 8, 8)]


def test_runs_are_cpu_attn_then_each_configuration_at_each_block_size() -> None:
    cells = bench_e2e.plan_cells([(4096, 4)], [], 16)
    runs = bench_e2e.plan_runs(["default", "pool", "pool-all"], [128, 16], cells)
    assert [r.label() for r in runs] == [
        "CPU_ATTN (block 128)",
        "ACTIVEKV exact, block 128, default options (in place, no pool)",
        "ACTIVEKV exact, block 16, default options (in place, no pool)",
        "ACTIVEKV exact, block 128, pool 256 blocks",
        "ACTIVEKV exact, block 16, pool 256 blocks",
        "ACTIVEKV exact, block 128, pool 132 blocks (the batch's contexts)",
        "ACTIVEKV exact, block 16, pool 1044 blocks (the batch's contexts)",
    ]
    assert runs[0].block_size is None and runs[1].block_size is None  # vLLM's default block size, as a user gets it
    assert runs[3].options == {"placement": "pool"} and runs[1].options == {}


def _synthetic() -> dict:
    runs = []
    for i, run in enumerate(bench_e2e.plan_runs(["default"], [128, 16], bench_e2e.plan_cells([(4096, 8)], [2048], 4))):
        cells = bench_e2e.plan_cells([(4096, 8)], [2048], 4)
        for c in cells:
            c.ttft_s = [1.0 + i]  # CPU_ATTN 1 s, block 128 2 s, block 16 3 s
            if c.new_tokens:
                c.decode_ms = [[100.0 / (1 + i)] * 4]  # CPU_ATTN 80 tokens/s, then 160 and 240
        memory = [{"rss_before_mib": 100.0, "rss_end_mib": 200.0 + i, "rss_peak_mib": 300.0 + 10 * i,
                   "pool_bytes": 0}]
        runs.append(bench_e2e.summarise_run("tiny", "float32", run, cells, memory, 1.0))
    return {"setup": {"cells": {"tiny": {"decode": ["4096x8"], "ttft": [2048]}}}, "runs": runs}


def test_tables_divide_by_cpu_attn_of_the_same_cell() -> None:
    result = _synthetic()
    assert bench_e2e.columns(result) == ["default, block 128", "default, block 16"]
    assert bench_e2e.decode_ratios(result) == [("tiny", "float32", 4096, 8, "default, block 128", 2.0),
                                               ("tiny", "float32", 4096, 8, "default, block 16", 3.0)]
    assert bench_e2e.ttft_ratios(result) == [("tiny", "float32", 2048, "default, block 128", 2.0),
                                             ("tiny", "float32", 2048, "default, block 16", 3.0)]
    assert bench_e2e.decode_table(result)[2] == "| tiny | float32 | 4k | 8 | 80.0 | 100.0-100.0 | 2.00x | 3.00x |"
    assert bench_e2e.ttft_table(result)[2] == "| tiny | float32 | 2k | 1.00 | 2.00x | 3.00x |"
    assert bench_e2e.memory_extra(result) == [("tiny", "float32", "default", 128, 10.0, 1.0),
                                              ("tiny", "float32", "default", 16, 20.0, 2.0)]


def test_cli_rejects_a_zero_count_before_starting_anything() -> None:
    with pytest.raises(SystemExit) as exc:
        bench_e2e.main(["--new-tokens", "0"])
    assert exc.value.code == 2


def test_compressed_dense_runs_the_first_layers_dense_on_the_real_geometry_only() -> None:
    runs = bench_e2e.plan_runs(["compressed", "compressed-dense"], [128], bench_e2e.plan_cells([(8192, 8)], [], 8))
    assert [r.options for r in runs[1:]] == [{"mode": "compressed"}, {"mode": "compressed", "dense_layers": 10}]
    assert runs[2].label() == "ACTIVEKV compressed, block 128, dense_layers 10"
    assert bench_e2e.column_name("compressed-dense", 16) == "compressed dense 10, block 16"
    with pytest.raises(SystemExit):  # the tiny model has 2 layers: refused before any engine starts
        bench_e2e.main(["--models", "tiny", "--configs", "compressed-dense"])
