"""`kernels.set_batch_invariant_mode()`: plain PyTorch code becomes batch-invariant inside it.

Runs on CPU (the CPU kernels) and, where CUDA is present, on the GPU (the Triton kernels).
The negative control runs the same batch-vs-alone comparison with the mode off and must find
a difference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from detgate import kernels
from detgate.kernels.bits import same_bits

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class TinyLM(nn.Module):
    """An HF-style block written in plain torch: RMSNorm by mean, Linear layers, log_softmax."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm_w = nn.Parameter(torch.randn(hidden) * 0.1 + 1)
        self.up = nn.Linear(hidden, 2 * hidden, bias=True)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, H]
        var = x.pow(2).mean(-1, keepdim=True)
        h = x * torch.rsqrt(var + 1e-6) * self.norm_w
        h = h + self.down(F.silu(self.up(h)))
        return torch.log_softmax(self.head(h), dim=-1)


def _model(device: str, dtype=torch.float32) -> TinyLM:
    torch.manual_seed(0)
    # On GPU, Qwen3-8B's hidden size: the shapes where cuBLAS was measured not invariant.
    hidden = 4096 if device == "cuda" else 1024
    return TinyLM(hidden=hidden, vocab=512).to(device=device, dtype=dtype).eval()


def _batch_vs_alone_differs(model: TinyLM, x: torch.Tensor) -> bool:
    """True if any row computed in the full batch differs from it computed in a smaller one."""
    full = model(x)
    return any(not same_bits(model(x[:rows]), full[:rows]) for rows in (1, 2, 3, 5, 7))


@pytest.mark.parametrize("device", DEVICES)
def test_model_is_batch_invariant_inside_the_mode(device):
    model = _model(device)
    x = torch.randn(32, 1, model.up.in_features, device=device)
    with torch.inference_mode(), kernels.set_batch_invariant_mode():
        assert not _batch_vs_alone_differs(model, x)


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_mode_off_differs(device):
    # Without the mode, the library GEMMs pick per-M code paths (MKL at M = 1, 2, 3, 7 in fp32;
    # cuBLAS split-K at small M), and the rows change bits.
    model = _model(device, torch.float32 if device == "cpu" else torch.bfloat16)
    # cuBLAS keeps one kernel from M = 1 to beyond 64 on some shapes: compare with a large batch.
    x = torch.randn(64 if device == "cpu" else 1024, 1, model.up.in_features, device=device,
                    dtype=next(model.parameters()).dtype)
    with torch.inference_mode(), kernels.set_batch_invariant_mode(enabled=False):
        assert _batch_vs_alone_differs(model, x)


@pytest.mark.parametrize("device", DEVICES)
def test_ops_are_routed_to_the_kernels(device):
    torch.manual_seed(1)
    a = torch.randn(9, 256, device=device)
    w = torch.randn(128, 256, device=device)
    bias = torch.randn(128, device=device)
    logits = torch.randn(5, 300, device=device)
    with kernels.set_batch_invariant_mode():
        lin = F.linear(a, w, bias)
        mm = a @ w.t()
        lsm = torch.log_softmax(logits, dim=-1)
    assert same_bits(lin, kernels.matmul(a, w.t(), bias))
    assert same_bits(mm, kernels.matmul(a, w.t()))
    assert same_bits(lsm, kernels.log_softmax(logits, -1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_product_over_one_k_is_the_kernels_bits_without_a_launch_per_entry(device, dtype):
    """K = 1 (a rotary embedding's outer product) is a broadcast multiply in the mode: the
    same bits as kernels.matmul on each batch entry (one product per element, nothing to
    order)."""
    torch.manual_seed(3)
    x = torch.randn(3, 64, 1, device=device).to(dtype) * 7
    y = torch.randn(3, 1, 50, device=device).to(dtype) * 1e3
    with kernels.set_batch_invariant_mode():
        batched, single = torch.bmm(x, y), x[0] @ y[0]
    for i in range(3):
        assert same_bits(batched[i], kernels.matmul(x[i], y[i]))
    assert same_bits(single, batched[0])


@pytest.mark.parametrize("device", DEVICES)
def test_mode_is_restored_on_exit_even_after_an_error(device):
    a = torch.randn(3, 512, device=device)
    w = torch.randn(512, 64, device=device)
    before = torch.mm(a, w)
    with pytest.raises(RuntimeError), kernels.set_batch_invariant_mode():
        raise RuntimeError("boom")
    with kernels.set_batch_invariant_mode():
        pass
    assert same_bits(torch.mm(a, w), before)
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


@pytest.mark.parametrize("device", DEVICES)
def test_general_forms_match_torch(device):
    torch.manual_seed(2)
    a = torch.randn(6, 64, device=device)
    b = torch.randn(64, 32, device=device)
    c = torch.randn(6, 32, device=device)
    x = torch.randn(4, 5, 64, device=device)
    bb = torch.randn(4, 64, 16, device=device)
    h = torch.randn(3, 7, dtype=torch.bfloat16, device=device)
    with kernels.set_batch_invariant_mode():
        addmm = torch.addmm(c, a, b, beta=0.5, alpha=2.0)
        bmm = torch.bmm(x, bb)
        # K = 1 (a rotary embedding's outer product): rows too short for TMA descriptors.
        outer = torch.bmm(x[:, :, :1].contiguous(), bb[:, :1, :].contiguous())
        mean_all = x.mean(dim=(0, 2), keepdim=True)
        mean_typed = h.mean(-1, dtype=torch.float32)
        lsm_half = torch.log_softmax(h, -1)
        lsm_to_float = torch._log_softmax(h, -1, True)
    torch.testing.assert_close(addmm, torch.addmm(c, a, b, beta=0.5, alpha=2.0))
    torch.testing.assert_close(bmm, torch.bmm(x, bb))
    torch.testing.assert_close(outer, torch.bmm(x[:, :, :1], bb[:, :1, :]))
    torch.testing.assert_close(mean_all, x.mean(dim=(0, 2), keepdim=True))
    torch.testing.assert_close(mean_typed, h.mean(-1, dtype=torch.float32))
    assert lsm_half.dtype == torch.bfloat16 and lsm_to_float.dtype == torch.float32
    torch.testing.assert_close(lsm_to_float, torch.log_softmax(h.float(), -1))


@pytest.mark.parametrize("device", DEVICES)
def test_mean_rows_are_batch_invariant(device):
    x = torch.randn(40, 151936 // 16, device=device)
    with kernels.set_batch_invariant_mode():
        full = x.mean(-1)
        for rows in (1, 2, 3, 7, 33):
            assert same_bits(x[:rows].mean(-1), full[:rows])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_last_dim_mean_takes_the_same_bits_as_the_general_path(device, dtype):
    """A norm's mean over the last dim has a one-launch path on CUDA (the division folded into
    the sum's kernel); it must give the general path's bits (a permuted view takes that one),
    keepdim or not, and rows stay batch-invariant."""
    torch.manual_seed(5)
    x = torch.randn(6, 9, 100, device=device).to(dtype)
    via_view = x.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous: general path
    with kernels.set_batch_invariant_mode():
        fast, fast_kept = x.mean(-1), x.mean(-1, keepdim=True)
        general = via_view.mean(2)
        alone = x[2:3].mean(-1)
    assert fast.dtype == dtype and fast.shape == (6, 9) and fast_kept.shape == (6, 9, 1)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert same_bits(fast.view(bits), general.view(bits))
    assert same_bits(fast_kept.view(bits), fast.unsqueeze(-1).view(bits))
    assert same_bits(alone.view(bits), fast[2:3].view(bits))
