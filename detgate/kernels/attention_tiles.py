"""The tile configurations of the Triton paged attention, in a module that needs no triton.

A configuration is (BLOCK_M, BLOCK_N, num_warps, num_stages), the values of the
`kernels.attention_triton` constants named in `FIELDS`. `SHIPPED` is the one that module runs;
the others are the alternatives the attention benchmark times and the GPU tests check for the
same bits (the tile shape decides which program computes a query, never its reduction order).
"""

from __future__ import annotations

TileConfig = tuple[int, int, int, int]

FIELDS = ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES")
CONFIGS: list[TileConfig] = [(64, 64, 4, 3), (64, 64, 4, 2)]
SHIPPED = CONFIGS[0]
# Decode launches (one query per sequence: GROUP useful rows of a tile) take their own rows per
# program, warps and stages, with the BLOCK_N of the configuration in force: 16 rows (the MMA's
# smallest) instead of 64, on H200 4.2 TB/s of K/V against 3.4 at 4096 tokens of context; two
# stages rather than three: decode step 10.32 against 10.46 ms at 256 sequences, 5.24 against
# 5.28 at 64 (contexts of 256; bench/results/decode-ab-h200-2026-12-02-stages.json).
DECODE: tuple[int, int, int] = (16, 2, 2)  # BLOCK_M, num_warps, num_stages


def config_name(config: TileConfig) -> str:
    return "m{}n{}w{}s{}".format(*config)
