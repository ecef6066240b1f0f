"""NeuralMemory: manual equals the torch.func reference end to end; segments of any length equal one call."""

import pytest
import torch

from memgrad_hf.titans import NeuralMemory
from tests.helpers import rel_err


def _outer(mem, x, impl):
    mem.grad_impl = impl
    y, _ = mem(x)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    return [y, *torch.autograd.grad((y * probe).sum(), [x, *mem.parameters()])]


@pytest.mark.parametrize("depth,activation", [(1, "gelu"), (2, "gelu"), (2, "silu"), (3, "silu"), (4, "gelu")])
def test_layer_manual_equals_autograd_all_outer_grads(depth, activation):
    mem = NeuralMemory(32, heads=2, depth=depth, activation=activation, chunk_size=8, max_lr=0.5).double()
    x = torch.randn(2, 43, 32, dtype=torch.float64, requires_grad=True)  # 43: a partial last chunk
    for a, b in zip(_outer(mem, x, "manual"), _outer(mem, x, "autograd"), strict=True):
        assert rel_err(a, b) < 1e-10


def test_layer_manual_equals_autograd_fp32():
    # fp32 rounding differences grow through the chunk recurrence; fp64 above shows the math is identical.
    mem = NeuralMemory(32, heads=2, chunk_size=8, max_lr=0.5)
    x = torch.randn(2, 40, 32, requires_grad=True)
    for a, b in zip(_outer(mem, x, "manual"), _outer(mem, x, "autograd"), strict=True):
        assert rel_err(a, b) < 5e-5


@pytest.mark.parametrize("momentum,forget", [(True, True), (False, True), (True, False), (False, False)])
def test_segments_of_any_length_equal_one_call(momentum, forget):
    # fp64: the split changes the order of fp32 operations (GEMM shapes), whose rounding differs by BLAS build and
    # CPU (up to ~2e-5 in fp32 on an AMD EPYC); in fp64 any difference in the math itself stands out by 1e9.
    mem = NeuralMemory(16, heads=2, chunk_size=4, momentum=momentum, forget=forget, max_lr=0.5).double()
    x = torch.randn(3, 23, 16, dtype=torch.float64)
    with torch.no_grad():
        full, full_state = mem(x)
        state, parts = None, []
        for s, e in [(0, 1), (1, 6), (6, 7), (7, 7), (7, 15), (15, 23)]:  # (7, 7): an empty segment
            y, state = mem(x[:, s:e], state)
            parts.append(y)
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-12, rtol=0)
    assert state.seq_index == 23 and state.pending[0].shape[1] == 23 % 4
    for a, b in zip(state.weights, full_state.weights, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


def test_memory_learns_within_the_forward():
    # Repeating the same segment: retrieval of stored pairs improves as the memory is updated.
    torch.manual_seed(0)
    mem = NeuralMemory(16, chunk_size=8, max_lr=1.0, momentum=False, forget=False)
    x = torch.randn(1, 8, 16)
    with torch.no_grad():
        state = None
        losses = []
        for _ in range(4):
            k, v, lr, _, _ = mem._store_inputs(x)
            w, g = state.weights if state else tuple(mem.memory_weights), state.gamma if state else mem.memory_gamma
            from memgrad_hf.kernels.titans import memory_forward

            losses.append((memory_forward(list(w), g, k, mem.activation) - v).pow(2).mean().item())
            _, state = mem(x, state)
    assert losses[-1] < losses[0] * 0.9


def test_causal_and_state_detach():
    mem = NeuralMemory(16, heads=2, chunk_size=4)
    x = torch.randn(1, 12, 16)
    with torch.no_grad():
        y1, _ = mem(x)
        x2 = x.clone()
        x2[:, 9:] = torch.randn(1, 3, 16)
        y2, _ = mem(x2)
    assert torch.equal(y1[:, :9], y2[:, :9])
    _, st = mem(x.requires_grad_())
    assert not any(t.requires_grad for t in st.detach().weights)


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth"):
        NeuralMemory(16, depth=5)
    with pytest.raises(ValueError, match="activation"):
        NeuralMemory(16, activation="relu")
    with pytest.raises(ValueError, match="grad_impl"):
        NeuralMemory(16, grad_impl="vmap")
    with pytest.raises(ValueError, match="fan=True"):
        NeuralMemory(16, grad_impl="fan")
    with pytest.raises(ValueError, match="divisible"):
        NeuralMemory(15, heads=2)
    # each named (heads=0 and dim_head=0 divided by zero; a float chunk_size failed only in the first forward)
    for kw in ({"heads": 0}, {"dim_head": 0}, {"chunk_size": 2.5}, {"expansion": -1}, {"heads": True},
               {"depth": 2.0}, {"depth": True}):
        name, value = next(iter(kw.items()))
        with pytest.raises(ValueError, match=f"{name} must be a positive integer; got {value}"):
            NeuralMemory(16, **kw)
    with pytest.raises(ValueError, match="depth must be a positive integer; got '2'"):
        NeuralMemory(16, depth="2")
    # a nan / negative max_lr made the retrieval non-finite / the inner step climb; "no" is truthy
    for kw in ({"max_lr": float("nan")}, {"max_lr": -0.1}, {"max_lr": 0}, {"max_lr": True}, {"momentum": "no"},
               {"fan": "yes"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            NeuralMemory(16, **kw)
    from memgrad_hf.titans import TitansConfig

    with pytest.raises(ValueError, match="fan_frozen must be True or False; got 'yes'"):
        TitansConfig(fan_frozen="yes")
    with pytest.raises(ValueError, match="shape"):
        NeuralMemory(16)(torch.randn(2, 16))
    mem = NeuralMemory(16, chunk_size=4)
    _, state = mem(torch.randn(2, 6, 16))
    with pytest.raises(ValueError, match="holds 2 sequences but x has batch 3"):
        mem(torch.randn(3, 6, 16), state)


def test_bf16_autocast_and_bf16_weights():
    # Autocast: projections in bf16, the memory's own recurrence in its fp32 parameters' dtype; backward inside the
    # autocast region too. Stated tolerance: 3e-2 relative to the fp32 result (bf16 projections).
    mem = NeuralMemory(32, heads=2, chunk_size=8, max_lr=0.5)
    x = torch.randn(2, 20, 32, requires_grad=True)
    ref, _ = mem(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = mem(x)
        y.float().square().sum().backward()
    assert state.weights[0].dtype == torch.float32
    assert rel_err(y.float(), ref) < 3e-2
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in mem.parameters())
    mem_bf16 = NeuralMemory(32, heads=2, chunk_size=8, max_lr=0.5).bfloat16()
    mem_bf16.load_state_dict({k: v.bfloat16() for k, v in mem.state_dict().items()})
    y16, _ = mem_bf16(x.detach().bfloat16())
    assert y16.dtype == torch.bfloat16 and rel_err(y16.float(), ref) < 5e-2


@pytest.mark.parametrize("scale", [1.0, 0.05, 0.01])
def test_bf16_memory_holds_its_tolerance_on_small_hidden_states(scale):
    # Hidden states with a small rms (early layers, small inits): the norms' epsilon is fixed (1e-6), not the
    # dtype's (bf16: 7.8e-3, which swamped a mean square of 1e-4: 0.53 off at scale 0.01). Tolerance 3e-2.
    torch.manual_seed(0)
    mem = NeuralMemory(64, heads=2, chunk_size=8)
    x = torch.randn(2, 32, 64) * scale
    mem_bf16 = NeuralMemory(64, heads=2, chunk_size=8).bfloat16()
    mem_bf16.load_state_dict(mem.state_dict())
    with torch.no_grad():
        assert rel_err(mem_bf16(x.bfloat16())[0].float(), mem(x)[0]) < 3e-2
