"""Smoke tests of the Triton kernel families: each builds and runs one tiny call on a device kind and checks it
against torch. :func:`memgrad_hf.kernels.default_backend` runs a family's test once per process before it makes
Triton that family's default, so a GPU or driver where Triton cannot build falls back to the torch path."""

from __future__ import annotations

import torch


def head(kind: str) -> None:
    """A 4-token, 64-word cross-entropy through the Triton head against ``F.cross_entropy``."""
    from memgrad_hf.kernels import head_triton
    from memgrad_hf.kernels.head import Epilogue

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 16, generator=g).to(kind), torch.randn(64, 16, generator=g).to(kind)
    y = torch.tensor([0, 5, 63, 7], device=kind)
    tw = torch.full((4,), 0.25, device=kind)
    loss = head_triton.fused_cross_entropy(h, w, None, y, Epilogue(), tw, chunk_size=4, need_dx=True, need_dw=True,
                                           need_db=False)[0]
    ref = torch.nn.functional.cross_entropy(h @ w.t(), y)
    if not torch.allclose(loss, ref, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"smoke test: Triton loss {loss.item()} != {ref.item()}")
    # the statistics kernel (log-probs, entropy, top-1: TRL's fused-head trainers) over several column splits
    w = torch.randn(300, 16, generator=g).to(kind)  # three splits of 128 columns
    y = torch.tensor([0, 130, 299, 7], device=kind)
    st = head_triton.head_stats(h, w, None, y, Epilogue(), chunk_size=4, need_entropy=True, need_top1=True)
    logp = (h @ w.t()).log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)
    top1 = (h @ w.t()).argmax(-1) == y
    if not (torch.allclose(st.target - st.lse, logp.gather(1, y[:, None]).squeeze(1), rtol=1e-4, atol=1e-5)
            and torch.allclose(st.entropy, ent, rtol=1e-4, atol=1e-5) and torch.equal(st.top1, top1)):
        raise RuntimeError("smoke test: Triton head statistics differ from torch's")


def forge(kind: str) -> None:
    """One fused AdamW step of a 64 x 64 weight through the Triton FORGE kernel against its torch twin."""
    from memgrad_hf.kernels import forge as twin
    from memgrad_hf.kernels import forge_triton

    g = torch.Generator().manual_seed(0)
    # quarter-integer activations: dW is exact in any GEMM precision (TF32 included), so only a broken kernel differs
    dy, x = (torch.randint(-4, 5, (8, 64), generator=g).div(4).to(kind) for _ in range(2))
    w = torch.randn(64, 64, generator=g).to(kind)
    hp = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    out = []
    for step_fn in (forge_triton.linear_weight_step, twin.linear_weight_step):
        wi, st = w.clone(), {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}
        step_fn("adamw", dy, x, wi, st, hp, 1)
        out.append(wi)
    if not torch.allclose(out[0], out[1], rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"smoke test: Triton FORGE step differs from the torch twin by "
                           f"{(out[0] - out[1]).abs().max().item():.3g}")


def titans(kind: str) -> None:
    """The Titans row kernel (LayerNorm, loss gradient, LayerNorm backward), 2 memories x 4 tokens, against its twin."""
    from memgrad_hf.kernels import titans as twin
    from memgrad_hf.kernels import titans_rows_triton

    g = torch.Generator().manual_seed(0)
    m, k, v = (torch.randn(2, 4, 16, generator=g).to(kind) for _ in range(3))
    lr, gamma = torch.rand(2, 4, generator=g).to(kind), torch.randn(16, generator=g).to(kind)
    got, ref = (impl.ln_loss_grad(m, k, v, lr, gamma)[0] for impl in (titans_rows_triton, twin))
    if not torch.allclose(got, ref, rtol=1e-4, atol=1e-6):
        raise RuntimeError(f"smoke test: the Triton Titans row kernel differs from its torch twin by "
                           f"{(got - ref).abs().max():.3g}")


TESTS = {"head": head, "forge": forge, "titans": titans}
