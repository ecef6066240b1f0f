"""Exactness on a CUDA device, end to end (``python tests/gpu_checks.py``): what CI's CPU cannot show.

The compiled paths against their references, on the GPU: the chunked head (cuBLAS) against logits + HF's loss, the
patched model's loss and gradients, FORGE in ``Trainer`` (the compiled Triton update) against ``adamw_torch``, and the
Titans layer (compiled Triton forward) against ``vmap(grad)``. fp32 with TF32 off; one line per check, exit status 1 if
any check fails. Not collected by pytest (CI has no GPU); the kernel-level twin checks are
``tests/optim/_triton_twin_check.py cuda`` and ``tests/titans/_triton_twin_check.py cuda``.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEV = os.environ.get("MEMGRAD_CHECK_DEVICE", "cuda")  # "cpu" to try the script itself
FAILED: list[str] = []


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def report(name: str, err: float, tol: float) -> None:
    ok = err <= tol
    print(f"{'PASS' if ok else 'FAIL'} {name}: max rel err {err:.2e} (tol {tol:.0e})", flush=True)
    if not ok:
        FAILED.append(name)


def check_head(dtype: torch.dtype, tol: float) -> None:
    from memgrad_hf.functional import linear_cross_entropy, linear_logprobs

    g = torch.Generator(device=DEV).manual_seed(0)
    n, h, v = 1000, 256, 32768
    x = torch.randn(n, h, device=DEV, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=DEV, generator=g) * 0.05).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), device=DEV, generator=g)
    y[::7] = -100
    loss = linear_cross_entropy(x, w, y, label_smoothing=0.1, z_loss=1e-4)
    gx, gw = torch.autograd.grad(loss, (x, w))
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    z = xr @ wr.T
    ref = F.cross_entropy(z, y, label_smoothing=0.1) + 1e-4 * (torch.logsumexp(z[y != -100], -1) ** 2).mean()
    rx, rw = torch.autograd.grad(ref, (xr, wr))
    name = f"head linear_cross_entropy {str(dtype)[6:]}"
    report(f"{name} loss", rel(loss, ref), tol)
    report(f"{name} dX", rel(gx, rx), tol * 10)
    report(f"{name} dW", rel(gw, rw), tol * 10)
    lp, ent = linear_logprobs(x, w, y.clamp_min(0), temperature=0.7, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    logp = torch.log_softmax(xr @ wr.T / 0.7, -1)
    rlp = logp.gather(-1, y.clamp_min(0)[:, None])[:, 0]
    rent = -(logp.exp() * logp).sum(-1)
    report(f"head linear_logprobs {str(dtype)[6:]} logp", rel(lp, rlp), tol)
    report(f"head linear_logprobs {str(dtype)[6:]} entropy", rel(ent, rent), tol)


def check_patched_model() -> None:
    import memgrad_hf
    from tests.tiny_models import tiny_model, with_word_scaled_head

    # "+word_scale": a head module with its own forward (a learned scale per word, folded into the weight rows)
    for family, tied in (("llama", False), ("gemma2", True), ("qwen3", False), ("gemma2+word_scale", False)):
        name = family
        family, _, scaled = family.partition("+")
        model = tiny_model(family, tied=tied)
        model = (with_word_scaled_head(model) if scaled else model).to(DEV)
        ref = copy.deepcopy(model)
        memgrad_hf.patch_model(model, chunk_size=16)
        ids = torch.randint(3, 101, (2, 24), device=DEV)
        labels = ids.clone()
        labels[0, :5] = -100
        out, rout = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
        out.loss.backward()
        rout.loss.backward()
        err = max([rel(out.loss, rout.loss)] + [rel(p.grad, q.grad) for p, q in
                                                zip(model.parameters(), ref.parameters(), strict=True)])
        report(f"patch_model {name} {'tied' if tied else 'untied'} loss + every gradient", err, 1e-5)


def check_forge_trainer() -> None:
    from transformers import Trainer, TrainingArguments

    import memgrad_hf  # noqa: F401  (registers forge_*)
    from tests.test_trainer_integration import _data
    from tests.tiny_models import tiny_model

    model = tiny_model("llama").to(DEV)
    ref = copy.deepcopy(model)
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, m in (("forge_adamw", model), ("adamw_torch", ref)):
            args = TrainingArguments(output_dir=f"{tmp}/{name}", max_steps=4, per_device_train_batch_size=2,
                                     learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to="none",
                                     seed=0, data_seed=0, optim=name, lr_scheduler_type="linear", warmup_steps=2,
                                     weight_decay=0.1, max_grad_norm=1.0, dataloader_num_workers=0,
                                     disable_tqdm=True)
            t = Trainer(model=m, args=args, train_dataset=_data())
            t.train()
            losses[name] = [h["loss"] for h in t.state.log_history if "loss" in h]
    from memgrad_hf.kernels import default_backend

    print(f"  (FORGE backend on {DEV}: {default_backend('forge', torch.device(DEV))})")
    err = max(rel(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    report("forge_adamw in Trainer (clipping 1.0) vs adamw_torch: weights after 4 steps", err, 1e-5)
    lerr = max(abs(a - b) / abs(b) for a, b in zip(losses["forge_adamw"], losses["adamw_torch"], strict=True))
    report("forge_adamw vs adamw_torch: logged losses", lerr, 1e-5)


def check_forge_headroom() -> None:
    """FORGE's headroom (one allocator call, read per layer under exact clipping) equals what the public functions
    say: peak minus allocated."""
    from memgrad_hf.optim.forge_clip import headroom

    if not DEV.startswith("cuda"):
        return
    dev = torch.device(DEV)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    del x  # the peak now exceeds what is held by at least 64 MiB
    want = torch.cuda.max_memory_allocated(dev) - torch.cuda.memory_allocated(dev)
    got = headroom(dev)
    report(f"forge headroom ({got} bytes) vs max_memory_allocated - memory_allocated ({want})",
           abs(got - want) / max(want, 1), 0.0)


def check_forge_low_precision_trainer() -> None:
    """bf16 model, FORGE's default (bf16 state; AdamW and Lion) and 8-bit state (with gradient accumulation), 4
    Trainer steps with clipping: the Triton kernels
    against the torch path on the same device (the rounding noise is the same hash in both). The weight gradients
    come from different GEMMs (tensor-core tiles vs cuBLAS), so some bf16 roundings fall the other way and Adam
    magnifies them where v is tiny; over 4 steps that moves 1.8% (bf16 state) to 5.4% (8-bit state) of the weights
    more than one bf16 spacing apart (H100, 2026-11-23), while a wrong rule, bias correction or noise stream moves
    most of them. So: the total update (weights after minus before) must agree within 5% (relative L2), at most 10%
    of the weights may be more than one spacing apart, and the losses must agree within 1e-3."""
    from transformers import Trainer, TrainingArguments

    import memgrad_hf  # noqa: F401  (registers forge_*)
    from tests.test_trainer_integration import _data
    from tests.tiny_models import tiny_model

    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("  (skipped on CPU without TRITON_INTERPRET=1)")
        return
    base = tiny_model("llama").to(DEV, torch.bfloat16)
    # the last: a patch_model'ed model, whose head hands its weight gradient to FORGE in vocabulary blocks
    for optim, optim_args, accumulation, patch in (("forge_adamw", "state_dtype=auto", 1, False),
                                                   ("forge_adamw", "state_dtype=8bit,stochastic_rounding=true", 2,
                                                    False),
                                                   ("forge_lion", "state_dtype=auto", 1, False),
                                                   ("forge_adamw", "state_dtype=8bit,head_grad=recompute", 1, True)):
        runs = {}
        for impl in ("triton", "torch"):
            os.environ["MEMGRAD_BACKEND"] = impl
            m = copy.deepcopy(base)
            if patch:
                memgrad_hf.patch_model(m)
            with tempfile.TemporaryDirectory() as tmp:
                args = TrainingArguments(output_dir=tmp, max_steps=4, per_device_train_batch_size=2,
                                         learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to="none",
                                         seed=0, data_seed=0, optim=optim, optim_args=optim_args,
                                         max_grad_norm=1.0, dataloader_num_workers=0, disable_tqdm=True,
                                         use_cpu=DEV == "cpu", gradient_accumulation_steps=accumulation)
                t = Trainer(model=m, args=args, train_dataset=_data())
                t.train()
            runs[impl] = (m, [h["loss"] for h in t.state.log_history if "loss" in h])
        os.environ.pop("MEMGRAD_BACKEND", None)
        (mt, lt), (mr, lr_) = runs["triton"], runs["torch"]
        # Adam magnifies a flipped gradient rounding where v is tiny, so count how many weights differ by more than
        # one bf16 spacing rather than bound the largest difference
        far = sum(((p.float() - q.float()).abs() > torch.finfo(torch.bfloat16).eps * q.float().abs()).sum().item()
                  for p, q in zip(mt.parameters(), mr.parameters(), strict=True))
        total = sum(p.numel() for p in mr.parameters())
        what = (f"{optim} {optim_args}, accumulation {accumulation}, bf16 {'patched ' if patch else ''}model: "
                f"Triton vs torch path")
        report(f"{what}, fraction of weights > 1 bf16 spacing apart", far / total, 0.10)
        pairs = list(zip(mt.parameters(), mr.parameters(), base.parameters(), strict=True))
        num = sum(((p.float() - q.float()) ** 2).sum().item() for p, q, _ in pairs)
        den = sum(((q.float() - b.float()) ** 2).sum().item() for _, q, b in pairs)
        report(f"{what}, total update (relative L2)", (num / den) ** 0.5, 0.05)
        report(f"{what}, losses",
               max(abs(a - b) / abs(b) for a, b in zip(lt, lr_, strict=True)), 1e-3)


def _forge_beside_adamw(model: torch.nn.Module, run, max_grad_norm: float, micro_batches: int = 1,
                        steps: int = 3) -> tuple[float, float]:
    """``steps`` plain-loop steps of ``run`` (``model``, compiled or not) under ForgeAdamW with exact clipping, beside
    torch.optim.AdamW + clip_grad_norm_ on an eager deep copy taken first: (largest weight error, largest grad-norm
    error), both relative. The weights are compared per parameter in relative L2, as the CPU tests do: Adam divides by
    sqrt(v), so where a weight's gradient is ~0 a last-bit difference in the summation order becomes a visible
    element (5e-5 of the largest weight after 3 steps on CPU, at 5e-6 relative L2)."""
    from memgrad_hf.optim import ForgeAdamW

    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, weight_decay=0.1, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    norm_err = 0.0
    for step in range(steps):
        for mb in range(micro_batches):
            ids = torch.randint(3, 101, (2, 24), generator=torch.Generator().manual_seed(10 * step + mb)).to(DEV)
            opt.sync = mb == micro_batches - 1
            run(input_ids=ids, labels=ids).loss.backward()
            ref(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        theirs = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm))
        assert theirs > max_grad_norm, f"clipping inactive (norm {theirs})"
        norm_err = max(norm_err, abs(opt.last_grad_norm - theirs) / theirs)
        ref_opt.step()
        ref_opt.zero_grad()
    werr = max(((p - q).norm() / q.norm()).item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return werr, norm_err


def check_forge_exact_clipping() -> None:
    """FORGE's exact clipping (a norm pass, then the update pass) on the device's own paths: compiled by inductor
    (plain, and with checkpointing + accumulation + tied weights, where the norm-only backward and the update
    backward run through one compiled graph), and a patch_model'ed head that computes its gradients in forward
    (``grad_in_forward=True``), whose consumer hands FORGE the head's weight gradient in vocabulary blocks."""
    import memgrad_hf
    from tests.tiny_models import tiny_model

    torch._dynamo.reset()
    model = tiny_model("llama").to(DEV)
    werr, nerr = _forge_beside_adamw(model, torch.compile(model), max_grad_norm=0.05)
    report(f"compiled (inductor) forge_adamw, clipping 0.05, vs AdamW + clip_grad_norm_ on {DEV}: weights (rel L2)",
           werr, 1e-5)
    report("compiled forge_adamw: grad norm", nerr, 1e-5)
    torch._dynamo.reset()
    model = tiny_model("llama", tied=True).to(DEV)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    werr, nerr = _forge_beside_adamw(model, torch.compile(model), max_grad_norm=0.05, micro_batches=2)
    report("compiled forge_adamw + checkpointing + 2 micro-batches + tied, clipping 0.05: weights", werr, 1e-5)
    report("compiled forge_adamw + checkpointing + accumulation: grad norm", nerr, 1e-5)
    torch._dynamo.reset()
    for grad_in_forward in (True, False):
        model = tiny_model("llama").to(DEV)
        memgrad_hf.patch_model(model, chunk_size=16, grad_in_forward=grad_in_forward)
        werr, nerr = _forge_beside_adamw(model, model, max_grad_norm=0.05)
        report(f"patch_model(grad_in_forward={grad_in_forward}) + forge_adamw, clipping 0.05: weights", werr, 1e-5)
        report(f"patch_model(grad_in_forward={grad_in_forward}) + forge_adamw: grad norm", nerr, 1e-5)


def _host_waits_per_step(layers: int, optim_cls: type, kwargs: dict, patch: bool) -> int:
    """How often the third plain-loop step of a bf16 tiny Llama with ``layers`` decoder layers makes the host wait for
    the device. CUDA: the synchronizing calls torch's sync debug mode reports. CPU (the Triton path under the
    interpreter): host reads of tensor values (``item``, ``bool``, ``float``, ``int``, ``tolist``) in memgrad's code,
    except of the step counters, which live on the CPU on a GPU too (as torch.optim keeps them)."""
    import warnings

    import memgrad_hf
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", num_hidden_layers=layers).to(DEV, torch.bfloat16)
    if patch:
        memgrad_hf.patch_model(model)
    opt = optim_cls(model.parameters(), model=model, lr=1e-3, **kwargs)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), device=DEV)

    def one_step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    one_step(), one_step()  # (state created, kernels built)
    if DEV.startswith("cuda"):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                one_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)
    counters = {id(st["step"]) for st in opt.state.values() if "step" in st}
    reads = [0]
    names = ("item", "__bool__", "__float__", "__int__", "tolist")
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def counting(name: str):
        def read(self, *a, **k):
            if id(self) not in counters and any("memgrad_hf" in f.f_code.co_filename for f in _frames()):
                reads[0] += 1
            return originals[name](self, *a, **k)
        return read

    for n in names:
        setattr(torch.Tensor, n, counting(n))
    try:
        one_step()
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)
    return reads[0]


def _frames():
    f = sys._getframe(2)
    for _ in range(4):  # the caller and a few above: memgrad's own code, not a library it calls
        if f is None:
            return
        yield f
        f = f.f_back


def check_forge_host_waits() -> None:
    """FORGE's step on a GPU must not wait for the device once per layer: at batch 1 the step is bound by the host,
    which can only run ahead while nothing makes it wait. The waits of one step are counted with 2 and with 4 decoder
    layers (16 and 30 fused linear layers, their norms hooked): the two counts must be equal."""
    from memgrad_hf.optim import ForgeAdamW, ForgeLion

    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("  (skipped on CPU without TRITON_INTERPRET=1)")
        return
    configs = [("ForgeAdamW, bf16 state", ForgeAdamW, {}, False),
               ("ForgeLion + patch_model", ForgeLion, {}, True),
               ("ForgeAdamW, 8-bit state, stochastic rounding", ForgeAdamW,
                {"state_dtype": "8bit", "stochastic_rounding": True}, False)]
    if DEV.startswith("cuda"):  # (on CPU the norm pass's per-tensor sums are host dots by design)
        configs.append(("ForgeAdamW + exact clipping", ForgeAdamW, {"max_grad_norm": 1.0}, False))
    import memgrad_hf.optim.forge as forge

    small = forge._MIN_8BIT_NUMEL
    forge._MIN_8BIT_NUMEL = 0  # (the tiny model's matrices are below the default)
    os.environ["MEMGRAD_BACKEND"] = "triton"  # (a GPU's default; on CPU the kernels run under the interpreter)
    try:
        for name, cls, kwargs, patch in configs:
            two, four = (_host_waits_per_step(n, cls, kwargs, patch) for n in (2, 4))
            print(f"  ({name}: {two} host waits per step with 2 layers, {four} with 4)")
            report(f"FORGE on {DEV}, {name}: host waits per step do not grow with the layers", float(four - two), 0)
    finally:
        forge._MIN_8BIT_NUMEL = small
        os.environ.pop("MEMGRAD_BACKEND", None)


def check_triton_head() -> None:
    """The Triton head kernels (the default on CUDA) end to end: loss, log-probs, entropies and gradients
    against the torch path on the same GPU."""
    from memgrad_hf.functional import linear_cross_entropy, linear_logprobs

    g = torch.Generator(device=DEV).manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(777, 256, device=DEV, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(32768, 256, device=DEV, generator=g) * 0.05).to(dtype).requires_grad_()
        y = torch.randint(0, 32768, (777,), device=DEV, generator=g)
        y[::5] = -100
        res = {}
        for backend in ("torch", "triton"):
            os.environ["MEMGRAD_BACKEND"] = backend
            try:
                loss = linear_cross_entropy(x, w, y, label_smoothing=0.1, softcap=30.0)
                lp, ent = linear_logprobs(x, w, y.clamp_min(0), temperature=0.7, return_entropy=True)
                res[backend] = (loss, lp, ent, *torch.autograd.grad(loss + (lp * 0.1).sum() + ent.mean(), (x, w)))
            finally:
                os.environ.pop("MEMGRAD_BACKEND", None)
        err = max(rel(a, b) for a, b in zip(res["triton"], res["torch"], strict=True))
        report(f"Triton head kernels vs torch path, {str(dtype)[6:]} (CE + log-probs + entropies, all gradients)",
               err, tol)


def check_titans() -> None:
    from memgrad_hf.titans import NeuralMemory

    torch.manual_seed(0)
    mem = NeuralMemory(64, heads=4, dim_head=16, depth=2, chunk_size=16).to(DEV)
    ref = copy.deepcopy(mem)
    ref.grad_impl = "autograd"
    x = torch.randn(2, 100, 64, device=DEV)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = mem(x1)[0], ref(x2)[0]
    probe = torch.randn_like(y1)
    (y1 * probe).sum().backward()
    (y2 * probe).sum().backward()
    err = max([rel(y1, y2), rel(x1.grad, x2.grad)] + [rel(p.grad, q.grad) for p, q in
                                                      zip(mem.parameters(), ref.parameters(), strict=True)])
    report("titans NeuralMemory (manual kernel) vs vmap(grad): output, input and every parameter gradient", err, 1e-4)
    # store mask: what padded tokens hold never reaches the other tokens' outputs
    mask = torch.ones(2, 100, device=DEV)
    mask[0, :37] = 0
    mask[1, 50:60] = 0
    noisy = torch.where(mask[..., None].bool(), x, x + 10 * torch.randn_like(x))
    with torch.no_grad():
        a, b = mem(x, mask=mask)[0], mem(noisy, mask=mask)[0]
    keep = mask.bool()
    report(f"titans store mask on {DEV}: real tokens unchanged by padding content", rel(a[keep], b[keep]), 1e-6)


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(0) if DEV.startswith("cuda") else "CPU"
    print(f"# {name}, torch {torch.__version__}", flush=True)
    checks = [lambda: check_head(torch.float32, 1e-5), lambda: check_head(torch.bfloat16, 2e-2), check_patched_model,
              check_triton_head, check_forge_trainer, check_forge_exact_clipping, check_forge_headroom,
              check_forge_low_precision_trainer,
              check_forge_host_waits, check_titans]
    for c in checks:
        try:
            c()
        except Exception:
            traceback.print_exc()
            FAILED.append(getattr(c, "__name__", "check"))
    print(f"{len(FAILED)} failed: {FAILED}" if FAILED else "all passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
