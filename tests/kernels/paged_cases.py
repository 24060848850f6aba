"""Building paged-attention calls the way the engine makes them, for the attention tests.

A `World` holds per-sequence q/k/v for every position and a paged cache whose blocks are
scattered at random and whose unused slots hold NaN (so reading one shows up). `step` stores
the new tokens' K/V first, then attends, exactly as the engine does.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from detgate.kernels import attention, reference

# An implementation: anything with `store_kv` and `paged_attention` as kernels.attention has.
Impl = SimpleNamespace


@dataclass
class World:
    q: list[torch.Tensor]  # per sequence [L, Hq, D]
    k: list[torch.Tensor]  # per sequence [L, Hkv, D]
    v: list[torch.Tensor]
    blocks: list[list[int]]  # per sequence: its cache blocks, in position order
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def fresh_cache(self) -> World:
        """The same sequences and block layout over an empty (NaN) cache."""
        nan = float("nan")
        return World(self.q, self.k, self.v, self.blocks, torch.full_like(self.k_cache, nan),
                     torch.full_like(self.v_cache, nan))


def make_world(lens: list[int], hq: int, hkv: int, d: int, block_size: int,
               dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> World:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    blocks, used = [], 0
    for n in need:
        blocks.append(order[used:used + n])
        used += n

    def rand(n: int, h: int) -> torch.Tensor:
        return torch.randn(n, h, d, generator=gen).to(dtype).to(device)

    cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    return World([rand(n, hq) for n in lens], [rand(n, hkv) for n in lens],
                 [rand(n, hkv) for n in lens], blocks, cache, cache.clone())


def with_block_size(world: World, block_size: int, seed: int = 1) -> World:
    """The same sequences over an empty cache of another block size."""
    lens = [q.shape[0] for q in world.q]
    other = make_world(lens, world.q[0].shape[1], world.k[0].shape[1], world.q[0].shape[2],
                       block_size, world.q[0].dtype, str(world.q[0].device), seed)
    return World(world.q, world.k, world.v, other.blocks, other.k_cache, other.v_cache)


def step(world: World, chunks: list[tuple[int, int, int]], impl: Impl | None = None
         ) -> list[torch.Tensor]:
    """One engine step: chunks [(seq, start, end)] = positions start..end-1 of seq are new.

    Stores their K/V, attends, and returns each chunk's output [end - start, Hq, D].
    """
    impl = impl or attention
    device = world.k_cache.device
    bs = world.block_size
    d = world.q[0].shape[2]
    scale = d**-0.5
    slots, starts, seq_lens = [], [0], []
    for i, start, end in chunks:
        pos = torch.arange(start, end)
        table = torch.tensor(world.blocks[i])
        slots.append(table[pos // bs] * bs + pos % bs)
        starts.append(starts[-1] + end - start)
        seq_lens.append(end)
    width = max(len(world.blocks[i]) for i, _, _ in chunks)
    tables = torch.full((len(chunks), width), -1, dtype=torch.int32)
    for row, (i, _, _) in enumerate(chunks):
        tables[row, :len(world.blocks[i])] = torch.tensor(world.blocks[i], dtype=torch.int32)
    k = torch.cat([world.k[i][s:e] for i, s, e in chunks])
    v = torch.cat([world.v[i][s:e] for i, s, e in chunks])
    q = torch.cat([world.q[i][s:e] for i, s, e in chunks])
    impl.store_kv(k, v, world.k_cache, world.v_cache, torch.cat(slots).to(device))
    out = impl.paged_attention(q, world.k_cache, world.v_cache, tables.to(device),
                          torch.tensor(starts, dtype=torch.int32, device=device),
                          torch.tensor(seq_lens, dtype=torch.int32, device=device), scale)
    return list(out.split([e - s for _, s, e in chunks]))


def prefill(world: World, seqs: list[int], chunk: int | None = None, impl: Impl | None = None
            ) -> list[torch.Tensor]:
    """Prefill whole sequences together, in chunks of `chunk` tokens (None: one chunk each)."""
    lens = [world.q[i].shape[0] for i in seqs]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(d < n for d, n in zip(done, lens, strict=True)):
        chunks, owners = [], []
        for j, i in enumerate(seqs):
            if done[j] < lens[j]:
                end = lens[j] if chunk is None else min(lens[j], done[j] + chunk)
                chunks.append((i, done[j], end))
                owners.append(j)
                done[j] = end
        for j, out in zip(owners, step(world, chunks, impl), strict=True):
            outs[j].append(out)
    return [torch.cat(o) for o in outs]


def chunked_prefill(world: World, splits: list[int], impl: Impl | None = None) -> torch.Tensor:
    """Sequence 0 prefilled over a fresh cache, `splits` new tokens per step; its whole output."""
    cache = world.fresh_cache()
    outs, start = [], 0
    for n in splits:
        outs.append(step(cache, [(0, start, start + n)], impl)[0])
        start += n
    return torch.cat(outs)


def reference_output(world: World, i: int) -> torch.Tensor:
    """`kernels.reference`'s attention of sequence i's every position over the world's cache."""
    device = world.k_cache.device
    n = world.q[i].shape[0]
    table = torch.tensor([world.blocks[i]], dtype=torch.int32, device=device)
    return reference.paged_attention(world.q[i], world.k_cache, world.v_cache, table,
                                     torch.tensor([0, n], dtype=torch.int32, device=device),
                                     torch.tensor([n], dtype=torch.int32, device=device),
                                     world.q[i].shape[2]**-0.5)
