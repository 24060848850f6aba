"""The tile configurations of the Triton paged attention, in a module that needs no triton.

A configuration is (BLOCK_M, BLOCK_N, num_warps, num_stages), the values of the
`kernels.attention_triton` constants named in `FIELDS`. `SHIPPED` is the one that module runs;
the others are the alternatives the attention benchmark times and the GPU tests check for the
same bits (the tile shape decides which program computes a query, never its reduction order).
"""

from __future__ import annotations

TileConfig = tuple[int, int, int, int]

FIELDS = ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES")
CONFIGS: list[TileConfig] = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2)]
SHIPPED = CONFIGS[0]


def config_name(config: TileConfig) -> str:
    return "m{}n{}w{}s{}".format(*config)
