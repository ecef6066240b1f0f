"""``memgrad-hf bench compat --forge``: FORGE's steps against torch's AdamW on every model type (see
:func:`check_forge`)."""

from __future__ import annotations

import copy

import torch

from benchmarks.compat import _batch, _brief, _enable_checkpointing, _tiny, _tiny_vision, _why


def check_forge(family: str, vision: bool = False, steps: int = 2, max_grad_norm: float = 0.05,
                checkpointing: bool = False, logprobs: bool = False, lora: bool = False,
                task: str = "causal-lm", bf16: bool = False, compile: bool = False) -> tuple[str, str]:
    """``ForgeAdamW`` (exact clipping on: ``max_grad_norm`` below the tiny models' gradient norms) on a
    ``patch_model``ed model (the unpatched one where the head is refused) in a hand-written loop, against
    ``torch.optim.AdamW`` + ``clip_grad_norm_`` on the unpatched model: every parameter after ``steps`` steps
    (1e-5 of the largest weight, fp32; eps 1e-3 keeps AdamW's ~lr·sign(g) first step from turning rounding of a
    near-zero gradient element into a whole step). ``checkpointing``: both models under transformers' gradient
    checkpointing, reentrant (the case FORGE handles apart; transformers' default is non-reentrant). ``logprobs``:
    the loss is TRL's, the mean of per-token log-probs computed outside the model, through
    :func:`memgrad_hf.grpo.add_fused_lm_head` (FORGE updates the head in vocabulary blocks) against ``log_softmax``
    of the unpatched model's logits. ``lora``: a PEFT LoRA adapter on every linear layer
    (``target_modules="all-linear"``, rank 4, B initialised non-zero) trains instead of the model. ``task``: the
    model class (``benchmarks.compat.TASKS``; the head is patched where the model has one). ``bf16``: both models
    in bf16 (FORGE's default bf16 state, as torch's): FORGE computes each update in fp32 and rounds once where
    torch's bf16 AdamW rounds after every op, so "close" means the updates of all parameters together within 10%
    (relative L2, where the updates are not decided by rounding; ~2-4% on llama, gemma2, mamba, where memgrad's
    head alone leaves torch's bf16 run bit-identical or 1e-2 apart) and no parameter that torch moves left in place
    (see :func:`_bf16_update_differs`). ``compile``: FORGE's model runs under ``torch.compile`` (``aot_eager``: the
    graph capture and autograd partitioning of inductor, without its code generation), the reference eagerly."""
    import memgrad_hf
    from memgrad_hf.optim import ForgeAdamW

    try:
        model = _tiny_vision(family) if vision else _tiny(family, task)
        if bf16:
            model = model.to(torch.bfloat16)
    except Exception as e:
        return "untested", f"tiny config: {_why(e, 90)}"
    if lora:
        from peft import LoraConfig, get_peft_model

        try:
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                     lora_dropout=0.0, init_lora_weights=False))
        except Exception as e:
            return "untested", f"no LoRA adapter: {_why(e, 90)}"
    start = [p.detach().float().clone() for p in model.parameters()] if bf16 else []
    try:
        ref, unpatched, control, *compiled_control = (copy.deepcopy(model) for _ in range(4 if compile else 3))
    except Exception as e:
        return "untested", f"cannot copy the model: {_why(e, 80)}"
    head = model.get_output_embeddings()
    batch = _batch(task, head.weight.shape[0] if head is not None else 101)
    ids, labels = batch["input_ids"], batch["labels"]
    mask = labels[:, 1:] != -100 if logprobs else None
    hp = dict(lr=1e-2, eps=1e-3, weight_decay=0.1)

    def ref_loss(m: torch.nn.Module) -> torch.Tensor:
        if not logprobs:
            return m(**batch).loss
        logits = m(input_ids=ids).logits[:, :-1].float()
        lp = logits.log_softmax(-1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
        return -(lp * mask).sum() / mask.sum()

    def train_ref(m: torch.nn.Module, perturb: float = 0.0, compiled: bool = False) -> None:
        """torch's AdamW + clip_grad_norm_; ``perturb``: the weights are first scaled by 1 + perturb·N(0, 1);
        ``compiled``: the model under torch.compile (aot_eager)."""
        if perturb:
            gen = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for p in m.parameters():
                    p.mul_(1 + perturb * torch.randn(p.shape, generator=gen))
        opt_ref = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **hp)
        if compiled:
            torch._dynamo.reset()
        run = torch.compile(m, backend="aot_eager") if compiled else m
        for _ in range(steps):
            torch.manual_seed(1)
            ref_loss(run).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_grad_norm)
            opt_ref.step()
            opt_ref.zero_grad()

    if checkpointing:
        try:
            for m in (model, ref, unpatched, control):
                _enable_checkpointing(m, reentrant=True)
        except Exception as e:
            return "untested", f"no gradient checkpointing: {_why(e, 80)}"
    try:
        train_ref(ref)
    except Exception as e:
        return "untested", f"unpatched model fails on the tiny config: {_why(e, 80)}"

    def train(model: torch.nn.Module, patch: bool) -> None:
        if patch:
            memgrad_hf.patch_model(model, chunk_size=4)
        if logprobs:
            from memgrad_hf.grpo import add_fused_lm_head

            add_fused_lm_head(model, outputs=("log_probs",))
        opt = ForgeAdamW([p for p in model.parameters() if p.requires_grad], model=model,
                         max_grad_norm=max_grad_norm, **hp)
        if compile:
            torch._dynamo.reset()  # (each family afresh: dynamo's recompile limit counts per code object)
        run = torch.compile(model, backend="aot_eager") if compile else model
        for _ in range(steps):
            torch.manual_seed(1)
            if logprobs:  # a loss computed outside the model, as TRL's: through the optimizer's backward
                lp = run(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
                opt.backward(-(lp * mask).sum() / mask.sum())
            else:
                run(**batch).loss.backward()
            opt.step()
            opt.zero_grad()

    how = "patched head" if task != "seq-cls" else "no LM head"
    try:
        try:
            train(model, patch=task != "seq-cls")
        except memgrad_hf.UnsupportedModelError:  # the head is refused (prophetnet): FORGE alone
            how, model = "unpatched head", unpatched
            train(model, patch=False)
    except memgrad_hf.UnsupportedModelError as e:
        return "unsupported", _brief(str(e))
    except Exception as e:
        return "ERROR", _brief(f"{type(e).__name__}: {e}")
    base = model.get_base_model() if lora else model
    label = f"{type(base).__name__} ({how}{', LoRA' if lora else ''}{', compiled' if compile else ''}"
    if bf16:
        why, rel = _bf16_update_differs(model, ref, start)
        detail = f"{label}; updates {rel:.0e} apart"
        if why:
            # The control: torch's AdamW on the model FORGE trained (memgrad's head). Where FORGE is close to that run
            # and that run is as far from stock, the distance is the head's bf16 rounding, amplified by Adam (whose
            # first steps are ~lr·sign(g) for gradients above eps), not FORGE.
            try:
                if how == "patched head":
                    memgrad_hf.patch_model(control, chunk_size=4)
                train_ref(control)
            except Exception as e:
                return "MISMATCH", f"{why}; the control failed: {_why(e, 60)}"
            why_control, rel_control = _bf16_update_differs(model, control, start)
            if why_control:
                return "MISMATCH", why
            _, drift = _bf16_update_differs(control, ref, start)
            detail = (f"{detail} from stock, {rel_control:.0e} from torch's AdamW on the patched model, which is "
                      f"{drift:.0e} from stock: the head's bf16 rounding")
        return "close", detail + ")"
    scale = max(p.abs().max().item() for p in ref.parameters())
    worst, name = max(((p - q).abs().max().item(), n) for (n, p), q in
                      zip(model.named_parameters(), ref.parameters(), strict=True))
    if worst > 1e-5 * scale and compile:
        # The control: torch's AdamW on the same model compiled (the head patched as FORGE's). Where compiling changes
        # the model's own training, FORGE compiled is compared with that: random ops draw differently (big_bird); a
        # graph break (the chunked head's) makes a layer whose output crosses it but not the loss (an MLM pooler) get
        # a zero gradient instead of none, so AdamW decays it (fnet, layoutlm, luke)
        stock = compiled_control[0]
        if how == "patched head":
            memgrad_hf.patch_model(stock, chunk_size=4)
        train_ref(stock, compiled=True)
        drift = max((p - q).abs().max().item() for p, q in zip(stock.parameters(), ref.parameters(), strict=True))
        if drift > 1e-5 * scale:
            ours = max((p - q).abs().max().item() for p, q in zip(model.parameters(), stock.parameters(),
                                                                  strict=True))
            if ours > 1e-5 * scale:
                return "MISMATCH", f"{name}: {ours / scale:.1e} of the largest weight from torch's AdamW compiled"
            return "exact", (f"{label}; {ours / scale:.0e} from torch's AdamW on it compiled, which is "
                             f"{drift / scale:.0e} from stock eager)")
    if worst > 1e-5 * scale:
        # The control: the stock run from weights moved by 1e-7 (relative, rounding-sized). Where that moves the
        # result past the tolerance too, the model's own training is chaotic at this size (a top-1 router's
        # choice flipping: switch_transformers) and the comparison cannot tell a bug from rounding.
        train_ref(control, perturb=1e-7)
        drift = max((p - q).abs().max().item() for p, q in zip(control.parameters(), ref.parameters(), strict=True))
        if drift > 1e-5 * scale:
            return "untested", (f"chaotic: stock training from weights moved by 1e-7 ends {drift / scale:.0e} away "
                                f"(memgrad {worst / scale:.0e})")
        return "MISMATCH", f"{name}: {worst / scale:.1e} of the largest weight"
    return "exact", f"{label}; {worst / scale:.0e})"


_BF16_EPS = torch.finfo(torch.bfloat16).eps  # a bf16 spacing, relative


def _bf16_update_differs(model: torch.nn.Module, ref: torch.nn.Module, start: list[torch.Tensor],
                         ) -> tuple[str | None, float]:
    """Why FORGE's bf16 training (``model``) is not torch's (``ref``), both from the weights ``start`` (None if it
    is), and how far apart their updates are (relative L2).

    Compared where torch's update is at least 4 bf16 spacings of the weight. A weight near 1 with an update of a
    spacing or two (norm weights, mamba's ``D``) is moved by rounding as much as by the update: FORGE rounds each
    step's exact update to the nearest bf16 once (two steps of 0.0026 leave a weight of 1.0 in place, whose fp32
    run moves by 0.0052; ``stochastic_rounding=True`` is the remedy), torch's bf16 AdamW after every op of its bf16
    state (it moved 2 of the 8 such elements of bart's last norm by a spacing). Rounding alone cannot move the
    larger updates, all parameters together, by 10% (relative L2), nor leave a parameter untouched whose update
    torch makes that large in more than a tenth of its elements.
    """
    num = den = 0.0
    for (name, p), q, w0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        mine, theirs = p.detach().float() - w0, q.detach().float() - w0
        big = theirs.abs() > 4 * _BF16_EPS * w0.abs()  # updates of 4 spacings and more: not decided by rounding
        num += (mine - theirs)[big].pow(2).sum().item()
        den += theirs[big].pow(2).sum().item()
        moved = big.float().mean().item()
        if moved > 0.1 and not mine[big].any():
            why = f"{name}: not updated (torch's bf16 AdamW moves {moved:.0%} of it by 4 spacings or more)"
            return why, float("inf")
    rel = (num / den) ** 0.5 if den else float(num > 0)
    return (f"the updates differ by {rel:.1e} (relative L2) from torch's bf16 AdamW" if rel > 0.1 else None), rel
