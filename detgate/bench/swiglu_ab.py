"""SwiGLU's first half on the GPU, one launch against two, per call and in the MLP's chain.

    PYTHONPATH=. python -m detgate.bench.swiglu_ab --out OUT_DIR [--m 1,8,64,256,640,1250]

Qwen3-8B's gate_up_proj (24,576 x 4,096, bf16) at each M, ms per call in CUDA graphs of
back-to-back calls (`timing.graph_ms`), the shipped tile choice:
- `matmul`: the gate_up matmul alone;
- `two`: the matmul, then `kernels.silu_and_mul` (what the engine runs);
- `fused`: `kernels.matmul_silu_and_mul`, one launch;
- `mlp_two` / `mlp_fused`: the same followed by down_proj (12,288 -> 4,096), as a decode step
  runs them one after the other (PDL lets a launch start beside its predecessor's last tiles).
Every fused output is checked against the two launches' bits. Writes OUT_DIR/swiglu-ab.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from detgate import kernels
from detgate.bench.kernels_gpu import environment
from detgate.bench.timing import graph_ms
from detgate.kernels.bits import same_bits

HIDDEN, INTERMEDIATE = 4096, 12288


def run(m_values: list[int]) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02

    gate_up, down = randn(2 * INTERMEDIATE, HIDDEN), randn(HIDDEN, INTERMEDIATE)
    calls = {
        "matmul": lambda x: kernels.matmul(x, gate_up.t()),
        "two": lambda x: kernels.silu_and_mul(kernels.matmul(x, gate_up.t())),
        "fused": lambda x: kernels.matmul_silu_and_mul(x, gate_up.t()),
        "mlp_two": lambda x: kernels.matmul(
            kernels.silu_and_mul(kernels.matmul(x, gate_up.t())), down.t()),
        "mlp_fused": lambda x: kernels.matmul(
            kernels.matmul_silu_and_mul(x, gate_up.t()), down.t()),
    }
    rows = {}
    for m in m_values:
        x = randn(m, HIDDEN) * 50
        row = {name: graph_ms(lambda _i, f=f, x=x: f(x), 1, m * 2 * INTERMEDIATE * 2)
               for name, f in calls.items()}
        row["same_bits"] = same_bits(calls["fused"](x), calls["two"](x))
        rows[str(m)] = row
        print(f"M={m:5d} " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in row.items()), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m detgate.bench.swiglu_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--m", default="1,8,64,256,640,1250")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    result = {"environment": environment(), "what": __doc__.split("\n\n")[2],
              "ms_by_m": run([int(m) for m in args.m.split(",")])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "swiglu-ab.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
