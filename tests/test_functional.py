"""memgrad_hf.functional against PyTorch references (fp32 tight, bf16 with stated tolerances)."""

import pytest
import torch
import torch.nn.functional as F

from memgrad_hf.functional import linear_cross_entropy, linear_logprobs, retain_head_grads
from tests.helpers import LargestTensor, entropy_grad_errors, rel_err

N, D, V = 45, 16, 103


def _inputs(dtype=torch.float32, bias=False, ignore_every=5):
    h = torch.randn(N, D, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, D) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(V, dtype=dtype, requires_grad=True) if bias else None
    y = torch.randint(0, V, (N,))
    if ignore_every:
        y[::ignore_every] = -100
    return h, w, b, y


def _ref_logits(h, w, b, softcap=None, scale=1.0, temperature=1.0):
    z = F.linear(h, w, b).float() * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def _params(h, w, b):
    return [h, w] + ([b] if b is not None else [])


CE_CASES = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2},
    {"softcap": 3.0},
    {"logit_scale": 0.5},
    {"logit_scale": 0.25, "softcap": 2.0, "label_smoothing": 0.05},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"reduction": "none", "label_smoothing": 0.2, "z_loss": 1e-3},
    {"reduction": "sum", "z_loss": 1e-2},
    {"label_smoothing": 1.0},
    {"num_items_in_batch": 50},
    {"num_items_in_batch": torch.tensor(61)},
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kw", CE_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "plain")
@pytest.mark.parametrize("chunk", [7, None])
def test_cross_entropy_matches_torch_fp32(kw, bias, chunk):
    h, w, b, y = _inputs(bias=bias)
    z = _ref_logits(h, w, b, kw.get("softcap"), kw.get("logit_scale", 1.0))
    red = "sum" if "num_items_in_batch" in kw else kw.get("reduction", "mean")
    ref = F.cross_entropy(z, y, label_smoothing=kw.get("label_smoothing", 0.0), reduction=red)
    if kw.get("z_loss"):
        zl = kw["z_loss"] * torch.logsumexp(z, -1).square() * (y != -100)
        ref = ref + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / (y != -100).sum()}[red]  # per token, reduced
    if "num_items_in_batch" in kw:
        ref = ref / kw["num_items_in_batch"]
    out = linear_cross_entropy(h, w, y, bias=b, chunk_size=chunk, **kw)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5
    g = torch.randn_like(ref) if ref.dim() else torch.tensor(1.7)
    for a, r in zip(torch.autograd.grad(out, _params(h, w, b), g), torch.autograd.grad(ref, _params(h, w, b), g),
                    strict=True):
        assert rel_err(a, r) < 1e-5


def test_cross_entropy_batched_shapes_and_no_grad():
    h = torch.randn(3, 5, D)
    w = torch.randn(V, D)
    y = torch.randint(0, V, (3, 5))
    with torch.no_grad():
        out = linear_cross_entropy(h, w, y, chunk_size=4)
    ref = F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten())
    assert rel_err(out, ref) < 1e-6
    none = linear_cross_entropy(h, w, y, reduction="none")
    assert none.shape == (3, 5)


@pytest.mark.parametrize("masked_rows", [False, True])  # a bias of -inf on vocabulary rows never to be predicted
@pytest.mark.parametrize("items", [None, 0, 4])  # 0: a Trainer's fully masked batch (num_items_in_batch=0)
def test_all_ignored_gives_torchs_value_and_zero_gradients(items, masked_rows):
    # the value as torch's (nan for a mean over no token), every gradient exactly 0 as torch gives ignored rows
    # (the weight's was nan, which a Trainer's clipping and optimizer spread to every weight; with an -inf bias the
    # value was nan where torch's is 0)
    h, w, b, y = _inputs(bias=True)
    y[:] = -100
    if masked_rows:
        with torch.no_grad():
            b[:3] = float("-inf")
    ours = linear_cross_entropy(h, w, y, bias=b, num_items_in_batch=items)
    ref = F.cross_entropy(F.linear(h, w, b), y, reduction="mean" if items is None else "sum")
    ref = ref if items is None else ref / items
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)) and (torch.isnan(ref) or ours.item() == ref.item() == 0)
    for g in torch.autograd.grad(ours, [h, w, b]):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_cross_entropy_bf16_close_to_torch(dtype):
    # bf16 logits are rounded exactly as nn.Linear rounds them; remaining differences come from summation order.
    h, w, b, y = _inputs(dtype=dtype, bias=True)
    ref = F.cross_entropy(F.linear(h, w, b).float(), y)
    gr = torch.autograd.grad(ref, [h, w, b])
    out = linear_cross_entropy(h, w, y, bias=b, chunk_size=8)
    go = torch.autograd.grad(out, [h, w, b])
    assert rel_err(out, ref) < 1e-5
    for a, r in zip(go, gr, strict=True):
        assert a.dtype == dtype
        assert rel_err(a, r) < 2e-2  # one bf16 rounding of the gradient (2^-8) plus accumulation order


def test_bf16_weight_gradient_fp32_accumulation_beats_bf16_accumulation():
    torch.manual_seed(1)
    n, d, v = 2048, 32, 64
    h = torch.randn(n, d, dtype=torch.bfloat16)
    w = torch.randn(v, d, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, v, (n,))
    exact = torch.autograd.grad(F.cross_entropy(F.linear(h.double(), w.double()), y), w)[0]
    g32 = torch.autograd.grad(linear_cross_entropy(h, w, y, chunk_size=16), w)[0]
    g16 = torch.autograd.grad(linear_cross_entropy(h, w, y, chunk_size=16, accum_dtype=torch.bfloat16), w)[0]
    assert rel_err(g32, exact) < rel_err(g16, exact)
    assert rel_err(g32, exact) < 8e-3


def test_autocast_matches_linear_under_autocast():
    h, w, b, y = _inputs(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w, b).float(), y)
        out = linear_cross_entropy(h, w, y, bias=b, chunk_size=8)
    assert rel_err(out, ref) < 1e-5
    for a, r in zip(torch.autograd.grad(out, [h, w, b]), torch.autograd.grad(ref, [h, w, b]), strict=True):
        assert a.dtype == torch.float32
        assert rel_err(a, r) < 2e-2


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7}, {"softcap": 5.0, "temperature": 1.3}, {"logit_scale": 2.0}])
@pytest.mark.parametrize("bias", [False, True])
def test_logprobs_and_entropy_match_log_softmax(kw, bias):
    h, w, b, y = _inputs(bias=bias)
    z = _ref_logits(h, w, b, kw.get("softcap"), kw.get("logit_scale", 1.0), kw.get("temperature", 1.0))
    ls = z.log_softmax(-1)
    mask = y != -100
    ref_lp = ls.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1) * mask
    ref_ent = -(ls.exp() * ls).sum(-1) * mask
    lp, ent = linear_logprobs(h, w, y, bias=b, return_entropy=True, chunk_size=6, **kw)
    assert rel_err(lp, ref_lp) < 1e-5 and rel_err(ent, ref_ent) < 1e-5
    g1, g2 = torch.randn_like(lp), torch.randn_like(ent)
    got = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), _params(h, w, b))
    exp = torch.autograd.grad((ref_lp * g1).sum() + (ref_ent * g2).sum(), _params(h, w, b), retain_graph=True)
    for a, r in zip(got, exp, strict=True):
        assert rel_err(a, r) < 1e-5
    # log-probs alone: the entropy branch of the gradient is skipped, results unchanged
    lp_only = linear_logprobs(h, w, y, bias=b, chunk_size=6, **kw)
    got = torch.autograd.grad((lp_only * g1).sum(), _params(h, w, b))
    exp = torch.autograd.grad((ref_lp * g1).sum(), _params(h, w, b))
    for a, r in zip(got, exp, strict=True):
        assert rel_err(a, r) < 1e-5


def test_logprobs_score_every_position_when_ignore_index_none():
    h, w, _, y = _inputs(ignore_every=0)
    lp = linear_logprobs(h, w, y, ignore_index=None)
    ref = (h @ w.T).log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)
    assert rel_err(lp, ref) < 1e-5


def test_never_materializes_tokens_by_vocab():
    n, d, v, chunk = 256, 16, 512, 16
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    y = torch.randint(0, v, (n,))
    with LargestTensor() as mode:
        linear_cross_entropy(h, w, y, chunk_size=chunk).backward()
        lp, ent = linear_logprobs(h, w, y, chunk_size=chunk, return_entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert mode.max_numel <= max(chunk * v, v * d), (mode.max_numel, mode.op)
    with LargestTensor() as full:
        F.cross_entropy(h @ w.T, y).backward()
    assert full.max_numel >= n * v  # the detector does see a full logits tensor


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda h, w, y: linear_cross_entropy(h, w.T, y), "hidden's last dim"),
        (lambda h, w, y: linear_cross_entropy(h, w, y.float()), "integer tensor"),
        (lambda h, w, y: linear_cross_entropy(h, w, y[:-1]), "shape"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=0), "chunk_size"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, reduction="avg"), "reduction"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, label_smoothing=1.5), "label_smoothing"),
        (lambda h, w, y: linear_cross_entropy(h.double(), w, y), "dtypes differ"),
        (lambda h, w, y: linear_cross_entropy(h, w, y + V), "outside"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, reduction="none", num_items_in_batch=3), "num_items"),
        (lambda h, w, y: linear_logprobs(h, w, y, temperature=0.0), "temperature"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, accum_dtype=torch.float16), "accum_dtype"),
        (lambda h, w, y: linear_cross_entropy(w, h, y), "swapped"),  # Liger's (weight, input) order
        (lambda h, w, y: linear_cross_entropy(h, w, y, bias=torch.zeros(V, dtype=torch.float64)), "bias"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, softcap=-30.0), "softcap"),
        (lambda h, w, y: linear_logprobs(h, w, y, softcap=0.0), "softcap"),
        # (each of these gave a NaN or a negative loss without a word, or an AttributeError / TypeError deep inside)
        (lambda h, w, y: linear_cross_entropy(h, w, y, softcap=float("inf")), "softcap .*None for no cap"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, logit_scale=float("nan")), "logit_scale"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, num_items_in_batch=-3), "num_items_in_batch"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, bias=0.5), "bias must be"),
        (lambda h, w, y: linear_logprobs(h, w, y, diagnostics=[]), "diagnostics"),
        (lambda h, w, y: linear_cross_entropy(h, w, y, weight_grad_consumer=3), "weight_grad_consumer"),
    ],
)
def test_bad_arguments_raise_value_error_with_fix(call, match):
    h, w, _, y = _inputs(ignore_every=0)
    with pytest.raises(ValueError, match=match):
        call(h, w, y)


def test_forcing_a_backend_without_kernel_is_a_clear_error(monkeypatch):
    h, w, _, y = _inputs()
    monkeypatch.setenv("MEMGRAD_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a GPU"):
        linear_cross_entropy(h, w, y)
    monkeypatch.setenv("MEMGRAD_BACKEND", "cuda")
    with pytest.raises(ValueError, match="MEMGRAD_BACKEND"):
        linear_cross_entropy(h, w, y)
    monkeypatch.setenv("MEMGRAD_BACKEND", "torch")
    assert torch.isfinite(linear_cross_entropy(h, w, y))


def test_no_grad_forward_does_one_gemm_per_chunk():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMM(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.mm.out,
                        torch.ops.aten.addmm.out, torch.ops.aten.addmm_.default):
                CountMM.n += 1
            return func(*args, **(kwargs or {}))

    h, w, _, y = _inputs(ignore_every=0)  # requires_grad=True, but no gradient is wanted
    with torch.no_grad(), CountMM():
        linear_cross_entropy(h, w, y, chunk_size=15)
    assert CountMM.n == 3  # 45 tokens / 15 per chunk, logits only


@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3}, {"num_items_in_batch": 30}])
def test_recompute_in_backward_equals_fused_forward(kw):
    h, w, b, y = _inputs(bias=True)
    a = linear_cross_entropy(h, w, y, bias=b, chunk_size=8, **kw)
    ga = torch.autograd.grad(a, [h, w, b])
    r = linear_cross_entropy(h, w, y, bias=b, chunk_size=8, grad_in_forward=False, **kw)
    gr = torch.autograd.grad(r, [h, w, b])
    assert rel_err(r, a) < 1e-6
    for x, z in zip(gr, ga, strict=True):
        assert rel_err(x, z) < 1e-5


@pytest.mark.parametrize("vocab_major", [True, False])
@pytest.mark.parametrize("recompute", [False, True])
def test_gemms_in_vocabulary_blocks_stay_exact(monkeypatch, recompute, vocab_major):
    # on CPU the logits GEMM runs in column blocks and the dX GEMM sums over row blocks (smaller MKL packing
    # buffers); with blocks narrower than the vocabulary (and a ragged last one) every path must still match torch,
    # in both chunk layouts (vocabulary-major: fp32 on CPU, the default here; token-major: elsewhere)
    from memgrad_hf.kernels import head as K

    assert K._vocab_major(torch.empty(1), torch.empty(1))  # what CPU fp32 runs by default
    monkeypatch.setattr(K, "_vocab_major", lambda hidden, weight: vocab_major)
    monkeypatch.setattr(K, "_LOGIT_COLS", 32)
    monkeypatch.setattr(K, "_DX_ROWS", 24)
    h, w, b, y = _inputs(bias=True)
    out = linear_cross_entropy(h, w, y, bias=b, chunk_size=16, grad_in_forward=not recompute, softcap=3.0)
    ref = F.cross_entropy(_ref_logits(h, w, b, softcap=3.0), y)
    assert rel_err(out, ref) < 1e-5
    for a, r in zip(torch.autograd.grad(out, [h, w, b]), torch.autograd.grad(ref, [h, w, b]), strict=True):
        assert rel_err(a, r) < 1e-5


@pytest.mark.parametrize("valid,chunk,consumer", [(13, 4, False), (13, None, False), (6, None, False),
                                                   (6, None, True), (13, 4, True)])
def test_few_token_chunks_keep_dx_as_accurate_as_torch(valid, chunk, consumer):
    # A dX GEMM with few rows (a chunk's remainder, a short batch) contracts over the whole vocabulary; a BLAS
    # small-matrix path that streams that into one running sum (MKL, 1-11 rows not a multiple of 4) lost ~2e-5
    # relative at a 200k vocabulary, where the target's term dwarfs the rest: 10x torch's one GEMM over all tokens
    torch.manual_seed(0)
    n, d, v = 16, 32, 200_058
    h = torch.randn(n, d)
    w = torch.randn(v, d) * 0.02
    y = torch.randint(0, v, (n,))
    y[: n - valid] = -100
    h64 = h.double().requires_grad_()
    F.cross_entropy(30.0 * torch.tanh((h64 @ w.double().t()) / 30.0), y).backward()

    def err(g):
        return ((g.double() - h64.grad).abs().max() / h64.grad.abs().max()).item()

    h32 = h.clone().requires_grad_()
    F.cross_entropy(_ref_logits(h32, w, None, softcap=30.0), y).backward()
    sink = (lambda *a: None) if consumer else None
    for grad_in_forward in (True, False):
        hm = h.clone().requires_grad_()
        linear_cross_entropy(hm, w.requires_grad_(consumer), y, softcap=30.0, chunk_size=chunk,
                             grad_in_forward=grad_in_forward, weight_grad_consumer=sink).backward()
        w.requires_grad_(False)
        assert err(hm.grad) <= 2 * err(h32.grad) + 1e-6, (grad_in_forward, err(hm.grad), err(h32.grad))


def test_default_chunk_size_rule():
    from memgrad_hf.kernels.head import default_chunk_size

    # 2.5x the fp32 hidden states, in multiples of 128 tokens: 640 at vocab 32768 (where 512 ran the GEMMs slower)
    assert default_chunk_size(8192, 1024, 32768) == 640
    assert default_chunk_size(8192, 1024, 32768, logit_bytes=2) == 1280
    # the 256-fp32-row floor decides at large vocabularies; never more tokens than there are
    assert default_chunk_size(8192, 1024, 128256) == 256 and default_chunk_size(8192, 896, 151936, 2) == 512
    assert default_chunk_size(100, 1024, 32768) == 100
    for n, d, v in [(8192, 4096, 32000), (3000, 512, 50257), (64, 8, 1000), (10**6, 8192, 256000)]:
        c = default_chunk_size(n, d, v)
        assert c <= n and (c % 128 == 0 if c >= 128 else c & (c - 1) == 0)
        assert c * v * 4 <= max(10 * n * d, 256 * v * 4, 16 * v * 4) and c * v * 4 <= max(256 << 20, 16 * v * 4)


@pytest.mark.parametrize("grad_in_forward", [None, True], ids=["recomputed", "held_from_forward"])
@pytest.mark.parametrize("kw", [{}, {"softcap": 3.0, "label_smoothing": 0.1}, {"z_loss": 1e-3}])
def test_weight_grad_consumer_receives_exact_blocks(kw, grad_in_forward):
    h, w, b, y = _inputs(bias=True)
    ref = linear_cross_entropy(h, w, y, bias=b, **kw)
    gh, gw, gb = torch.autograd.grad(ref, [h, w, b])
    got_w, got_b = torch.zeros_like(w), torch.zeros_like(b)

    def consumer(v0, v1, dw, db):
        got_w[v0:v1] += dw
        got_b[v0:v1] += db

    from memgrad_hf.kernels import head as K

    # the bias gradient goes with the weight's on either path: autograd gets neither
    out = linear_cross_entropy(h, w, y, bias=b, weight_grad_consumer=consumer, grad_in_forward=grad_in_forward, **kw)
    (2 * out).backward()
    assert w.grad is None and b.grad is None
    assert rel_err(out, ref) < 1e-6
    assert rel_err(h.grad, 2 * gh) < 1e-5 and rel_err(got_w, 2 * gw) < 1e-5 and rel_err(got_b, 2 * gb) < 1e-5
    if grad_in_forward:
        return
    # with a tiny block budget the vocabulary is walked in several blocks, with the same result
    real = K.head_backward_vocab_blocks
    calls = []

    def small_blocks(*a, **k):
        return real(*a, **{**k, "block_bytes": 16 * 4 * h.shape[0]})

    K.head_backward_vocab_blocks = small_blocks
    try:
        got_w.zero_()
        got_b.zero_()
        out = linear_cross_entropy(h, w, y, bias=b, weight_grad_consumer=lambda *a: (calls.append(a[:2]),
                                   consumer(*a)), **kw)
        out.backward()
    finally:
        K.head_backward_vocab_blocks = real
    assert len(calls) > 2 and calls[0][0] == 0 and calls[-1][1] == V
    assert all(a[1] == b[0] for a, b in zip(calls, calls[1:], strict=False))  # contiguous, in order
    assert rel_err(got_w, gw) < 1e-5 and rel_err(got_b, gb) < 1e-5


def test_weight_grad_consumer_receives_the_blocks_with_reduction_none():
    # reduction="none" (a model's own per-token loss under patch_model) dropped the consumer: the whole [V x H]
    # gradient went to autograd, what FORGE's fused head exists to avoid
    h, w, b, y = _inputs(bias=True)
    scale = torch.rand(y.shape)
    ref = (linear_cross_entropy(h, w, y, bias=b, reduction="none", label_smoothing=0.1) * scale).sum()
    gh, gw, gb = torch.autograd.grad(ref, [h, w, b])
    got_w, got_b = torch.zeros_like(w), torch.zeros_like(b)

    def consumer(v0, v1, dw, db):
        got_w[v0:v1] += dw
        got_b[v0:v1] += db

    out = linear_cross_entropy(h, w, y, bias=b, reduction="none", label_smoothing=0.1, weight_grad_consumer=consumer)
    (out * scale).sum().backward()
    assert w.grad is None and b.grad is None
    assert rel_err(h.grad, gh) < 1e-5 and rel_err(got_w, gw) < 1e-5 and rel_err(got_b, gb) < 1e-5


def test_vocabulary_blocks_are_aligned():
    # bf16 logits blocks with a row stride that is not a multiple of 8 elements push cuBLAS onto slow kernels
    from memgrad_hf.kernels.head import aligned_block

    for rows in (1, 16, 17, 100, 127, 128, 129, 1000, 4748, 1 << 20):
        b = aligned_block(rows)
        assert b % (128 if b >= 128 else 16) == 0 and b >= 16
        assert b <= max(rows, 16) and (b >= rows - 127 if rows >= 128 else b >= rows - 15)


@pytest.mark.parametrize("kw", [{}, {"softcap": 200.0, "z_loss": 1e-3}, {"label_smoothing": 0.1}])
def test_cross_entropy_exact_when_target_probability_underflows(kw):
    # Large logits: the target's softmax probability underflows (p_t < 1e-30 for most rows), so the fused path cannot
    # take log-sum-exp as z_t - log p_t and must recompute those rows; loss and gradients stay exact.
    h, w, b, y = _inputs(bias=True)
    with torch.no_grad():
        w.mul_(30)
    z = _ref_logits(h, w, b, kw.get("softcap"))
    ref = F.cross_entropy(z, y, label_smoothing=kw.get("label_smoothing", 0.0))
    if kw.get("z_loss"):
        ref = ref + (kw["z_loss"] * torch.logsumexp(z, -1).square() * (y != -100)).sum() / (y != -100).sum()
    p_t = torch.softmax(z, -1).gather(1, y.clamp_min(0)[:, None])[y != -100]
    assert (p_t < 1e-30).float().mean() > 0.5  # the case under test really happens
    out = linear_cross_entropy(h, w, y, bias=b, chunk_size=16, **kw)
    assert rel_err(out, ref) < 1e-5
    for a, r in zip(torch.autograd.grad(out, _params(h, w, b)), torch.autograd.grad(ref, _params(h, w, b)),
                    strict=True):
        assert rel_err(a, r) < 1e-5


def test_ids_are_checked_and_compacted_with_one_host_sync(monkeypatch):
    # every host sync stalls a GPU's launch queue: the ignore mask and the id range cost one together. What would
    # sync on a GPU (a value read back, or nonzero's data-dependent size) is counted at the Python methods.
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: (reads.append(_n),
                                                                                           _r(self, *a, **k))[1])
    h, w, _, y = _inputs()
    lp = linear_logprobs(h, w, y)
    assert len(reads) == 1, reads
    monkeypatch.undo()
    ref = (h @ w.T).log_softmax(-1).gather(-1, y.clamp(min=0)[:, None]).squeeze(-1) * (y != -100)
    assert rel_err(lp, ref) < 1e-5  # the compacted positions land back where they were
    bad = y.clone()
    bad[1] = V  # out of range next to ignored positions
    with pytest.raises(ValueError, match="outside"):
        linear_logprobs(h, w, bad)
    with pytest.raises(ValueError, match="outside"):  # -100 is an id like any other without an ignore_index
        linear_logprobs(h, w, y, ignore_index=None)


def test_stats_forward_chunk_spends_the_weight_gradients_bytes(monkeypatch):
    # On the Triton path the statistics' forward holds one logits buffer; its backward holds the weight gradient
    # plus one logits block. The forward chunk may take the gradient's bytes, never more, and only when the
    # backward will hold that gradient; the backward keeps its own chunk. Results are exact either way.
    import memgrad_hf.functional as Fn
    from memgrad_hf.kernels import head as K

    seen = {}
    real_stats, real_bwd = K.head_stats, K.head_backward
    monkeypatch.setattr(K, "LOGITS_IN_WEIGHT_DTYPE", True, raising=False)  # as the Triton head declares
    monkeypatch.setattr(K, "head_stats", lambda *a, **k: (seen.__setitem__("fwd", k["chunk_size"]),
                                                          real_stats(*a, **k))[1])
    monkeypatch.setattr(K, "head_backward", lambda *a, **k: (seen.__setitem__("bwd", k["chunk_size"]),
                                                             real_bwd(*a, **k))[1])
    n, d, v = 512, 200, 64
    h = torch.randn(n, d, requires_grad=True)
    w = (torch.randn(v, d) * 0.5).requires_grad_()
    y = torch.randint(0, v, (n,))
    fwd, bwd = Fn._stats_chunks(None, n, h, w)
    assert fwd > bwd and fwd * v * w.element_size() <= bwd * v * w.element_size() + w.numel() * w.element_size()
    assert fwd % 128 == 0
    lp = linear_logprobs(h, w, y)
    g = torch.autograd.grad(lp.sum(), (h, w))
    assert seen == {"fwd": fwd, "bwd": bwd}
    ref = (h @ w.T).log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)
    exp = torch.autograd.grad(ref.sum(), (h, w))
    assert rel_err(lp, ref) < 1e-5 and all(rel_err(a, b) < 1e-5 for a, b in zip(g, exp, strict=True))
    # no weight gradient to come (frozen head, no grad, a consumer taking it in blocks) or a chunk given: one size
    assert Fn._stats_chunks(None, n, h, w.detach()) == (bwd, bwd)
    with torch.no_grad():
        assert Fn._stats_chunks(None, n, h, w) == (bwd, bwd)
    assert Fn._stats_chunks(None, n, h, w, consumer=print) == (bwd, bwd)
    assert Fn._stats_chunks(7, n, h, w) == (7, 7)
    # bf16 logits: the same bytes hold twice the tokens (as default_chunk_size counts them)
    big_h, big_w = torch.empty(4096, 16), torch.empty(8192, 16, requires_grad=True)
    f32 = Fn._stats_chunks(None, 4096, big_h, big_w)
    bf16 = Fn._stats_chunks(None, 4096, big_h.bfloat16(), big_w.detach().bfloat16().requires_grad_())
    assert f32 == (256 + 16 - (256 + 16) % 128, 256) and bf16 == (512 + 16 - (512 + 16) % 128, 512)
    monkeypatch.setattr(K, "LOGITS_IN_WEIGHT_DTYPE", False)  # the torch path: several chunk-sized temporaries
    assert Fn._stats_chunks(None, n, h, w) == (bwd, bwd) and Fn._stats_chunks(None, 4096, big_h, big_w) == (256, 256)


def test_fused_chunk_spends_the_weight_gradients_cast(monkeypatch):
    # The Triton fused cross-entropy (bf16 weight, fp32 accumulator) re-reads its accumulator once per chunk; the
    # backward casts it to bf16 beside itself, so a forward logits buffer up to that size (hidden tokens) is free.
    import memgrad_hf.functional as Fn
    from memgrad_hf.kernels import head as K

    seen = []
    real = K.fused_cross_entropy
    monkeypatch.setattr(K, "LOGITS_IN_WEIGHT_DTYPE", True, raising=False)  # as the Triton head declares
    monkeypatch.setattr(K, "fused_cross_entropy", lambda *a, **k: (seen.append(k["chunk_size"]), real(*a, **k))[1])
    n, d, v = 1024, 768, 8192
    h = torch.randn(n, d).bfloat16().requires_grad_()
    w = (torch.randn(v, d) * 0.05).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,))
    base = K.default_chunk_size(n, d, v, 2)
    assert base < d  # the case where the cast's bytes buy more tokens
    loss = linear_cross_entropy(h, w, y, grad_in_forward=True)
    g = torch.autograd.grad(loss, (h, w))
    ref = linear_cross_entropy(h, w, y, grad_in_forward=True, chunk_size=base)
    g_ref = torch.autograd.grad(ref, (h, w))
    assert seen == [d, base]
    assert rel_err(loss, ref) < 1e-6 and all(rel_err(a, b) < 1e-2 for a, b in zip(g, g_ref, strict=True))
    # no cast to come: fp32 accumulation in the weight's own dtype, a frozen weight, or no gradient at all
    assert Fn._fused_chunk(n, w, torch.bfloat16, False) == base
    assert Fn._fused_chunk(n, w.detach(), torch.float32, False) == base
    assert Fn._fused_chunk(n, w, torch.float32, True) == base
    with torch.no_grad():
        assert Fn._fused_chunk(n, w, torch.float32, False) == base


def test_entropy_gradient_keeps_fp32_accuracy_at_large_logits():
    # logits of std ~40: the gradient -p (log p + H) must not be formed from terms of the logits' size (it was: 2.7x
    # fp32 autograd's largest error on the torch path, 3.4x on the Triton one, now 1.3x; see
    # tests/_head_triton_check.py). What is left is lse's own rounding (log p = z - lse), which log_softmax avoids.
    ours, fp32 = entropy_grad_errors()
    assert ours <= 2.0 * fp32, (ours, fp32)


@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1, "z_loss": 1e-2, "softcap": 3.0}, {"reduction": "none"}])
def test_fp64_inputs_are_computed_in_fp64(kw):
    # an fp64 model (or torch.autograd.gradcheck) gets fp64 numbers, not fp32 ones rounded back
    h, w, b, y = _inputs(torch.float64, bias=True)
    z = F.linear(h, w, b)
    if kw.get("softcap"):
        z = kw["softcap"] * torch.tanh(z / kw["softcap"])
    red = kw.get("reduction", "mean")
    ref = F.cross_entropy(z, y, label_smoothing=kw.get("label_smoothing", 0.0), reduction=red)
    if kw.get("z_loss"):
        ref = ref + (kw["z_loss"] * torch.logsumexp(z, -1).square() * (y != -100)).sum() / (y != -100).sum()
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [h, w, b], g)
    for grad_in_forward in (True, False):
        out = linear_cross_entropy(h, w, y, bias=b, chunk_size=8, grad_in_forward=grad_in_forward, **kw)
        assert out.dtype == torch.float64 and rel_err(out, ref) < 1e-13
        for a, r in zip(torch.autograd.grad(out, [h, w, b], g), ref_grads, strict=True):
            assert a.dtype == torch.float64 and rel_err(a, r) < 1e-13
    logp, ent = linear_logprobs(h, w, y, bias=b, return_entropy=True, temperature=0.7, chunk_size=8)
    ref_lp = torch.log_softmax(F.linear(h, w, b) / 0.7, -1)
    mask = y != -100
    assert logp.dtype == ent.dtype == torch.float64
    assert rel_err(logp[mask], ref_lp[mask].gather(1, y[mask, None]).squeeze(1)) < 1e-13
    assert rel_err(ent[mask], -(ref_lp.exp() * ref_lp).sum(-1)[mask]) < 1e-13


def test_gradcheck_in_fp64():
    torch.manual_seed(0)
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([3, -100, 0, 10, 7, 3])

    def ce(h, w, b):
        return linear_cross_entropy(h, w, y, bias=b, chunk_size=4, label_smoothing=0.1, z_loss=1e-2, softcap=2.0,
                                    grad_in_forward=False)  # gradcheck backpropagates repeatedly

    def logprobs_and_entropy(h, w, b):
        return linear_logprobs(h, w, y, bias=b, chunk_size=4, return_entropy=True, temperature=0.9)

    assert torch.autograd.gradcheck(ce, (h, w, b))
    assert torch.autograd.gradcheck(logprobs_and_entropy, (h, w, b))
    loss = linear_cross_entropy(h, w, y, bias=b, grad_in_forward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="grad_in_forward=False"):
        loss.backward()


@pytest.mark.parametrize("fn", ["cross_entropy_fused", "cross_entropy_recomputed", "logprobs"])
def test_create_graph_through_the_head_is_refused(fn):
    # a gradient penalty differentiates the head's gradient again; the kernels' gradients would enter that graph as
    # constants (second-order terms silently missing: 10% off, lm_head got no gradient at all)
    h, w, _, y = _inputs()
    if fn == "logprobs":
        out = linear_logprobs(h, w, y).sum()
    else:
        out = linear_cross_entropy(h, w, y, grad_in_forward=fn == "cross_entropy_fused")
    with pytest.raises(RuntimeError, match="create_graph=True.*skip_logits=False"):
        torch.autograd.grad(out, h, create_graph=True)


def test_uint8_labels_keep_every_id():
    # -100 does not exist in uint8: compared there it wrapped to 156, and id 156 was dropped as ignored
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, D, generator=g, requires_grad=True), torch.randn(300, D, generator=g)
    y = torch.tensor([156, 10, 200, 255, 0], dtype=torch.uint8)
    z = h @ w.T
    for kw in ({}, {"ignore_index": -1}):
        ref = F.cross_entropy(z, y.long(), reduction="none", **kw)
        assert rel_err(linear_cross_entropy(h, w, y, reduction="none", **kw), ref) < 1e-6
    assert rel_err(linear_logprobs(h, w, y), torch.log_softmax(z, -1).gather(1, y.long()[:, None])[:, 0]) < 1e-6


def test_fp64_is_left_alone_under_autocast():
    # as torch.autocast leaves fp64 ops alone (it was computed in bf16 and returned in fp32)
    h, w, b, y = _inputs(torch.float64, bias=True)
    plain = linear_cross_entropy(h, w, y, bias=b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = linear_cross_entropy(h, w, y, bias=b)
        with pytest.raises(ValueError, match="fp64"):
            linear_cross_entropy(h, w.float(), y)
    assert cast.dtype == torch.float64 and rel_err(cast, plain) < 1e-12


@pytest.mark.parametrize("grad_in_forward", [None, False])
def test_num_items_zero_divides_as_a_tensor_zero_does(grad_in_forward):
    # a Python 0 raised ZeroDivisionError on the fused path; torch.tensor(0) and the recompute path gave inf
    h, w, _, y = _inputs()
    got = linear_cross_entropy(h, w, y, num_items_in_batch=0, grad_in_forward=grad_in_forward)
    ref = linear_cross_entropy(h, w, y, num_items_in_batch=torch.tensor(0), grad_in_forward=grad_in_forward)
    assert torch.isinf(got) and got == ref


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused_by_name(transform):
    # torch's own errors ("Batching rule not implemented for aten::mm.out", "must override setup_context") named
    # neither the chunked head nor a way out
    h, w, _, y = _inputs()
    if transform == "grad":
        run = lambda: torch.func.grad(lambda x: linear_cross_entropy(x, w, y))(h)  # noqa: E731
    else:
        run = lambda: torch.func.vmap(lambda x: linear_logprobs(x, w, y))(h.unsqueeze(0).expand(2, -1, -1))  # noqa: E731
    with pytest.raises(RuntimeError, match=rf"memgrad_hf: the chunked LM head .* under torch.func \({transform}\)"):
        run()


def test_retain_head_grads_holds_in_the_thread_autograd_runs_the_backward_on():
    # on a GPU autograd runs the backward on a device thread, not the caller's: a flag kept per thread was not seen
    # there, and the second backward (FORGE's norm pass, then its update pass) failed. Here the backward runs on
    # another thread than the one that entered the context.
    import threading

    h, w, _, y = _inputs()
    loss = linear_cross_entropy(h, w, y, grad_in_forward=True)
    with retain_head_grads():
        worker = threading.Thread(target=lambda: torch.autograd.backward(loss, retain_graph=True))
        worker.start()
        worker.join()
    first = h.grad.clone()
    loss.backward()
    assert torch.allclose(h.grad, 2 * first)


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_an_in_place_change_of_the_weight_before_backward_raises_as_in_stock(grad_in_forward):
    # the fused path's gradients are the forward-time weight's: an optimizer step between forward and backward went
    # unnoticed there, where autograd's version check catches it for full logits (and for the recompute path)
    h, w, _, y = _inputs()
    w = w.detach().requires_grad_()
    loss = linear_cross_entropy(h, w, y, grad_in_forward=grad_in_forward)
    with torch.no_grad():
        w.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
