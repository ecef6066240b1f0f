"""``memgrad-hf bench compat --titans``: Titans injection on every model type (see :func:`check_titans`)."""

from __future__ import annotations

import torch

from benchmarks.compat import _brief, _enable_checkpointing, _grad_cosine, _tiny, _tiny_vision, _why


def _incremental_logits(model: torch.nn.Module, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of ``ids`` from a cached forward of the first ``prompt`` tokens, then one token per cached call."""
    import inspect

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids[:, :prompt], use_cache=True)
    steps = [out.logits]
    for t in range(prompt, ids.shape[1]):
        out = model(input_ids=ids[:, t:t + 1], use_cache=True, **{key: out.past_key_values})
        steps.append(out.logits)
    return torch.cat(steps, dim=1)


def _checkpointed_titans_differs(model: torch.nn.Module, ids: torch.Tensor, bf16: bool = False) -> str | None:
    """Every gradient of the training forward just back-propagated (in ``.grad``) against the same forward under
    gradient checkpointing, reentrant and not (1e-5 of each tensor's largest element, + 1e-6 of the largest of all;
    in bf16 all gradients together at cosine similarity >= 0.999: the memory adds a third use of the layer's input,
    whose gradient parts a reentrant segment sums in another order, and bf16 rounds the sums apart, ~1e-2 of a
    tensor after a few layers, where fp32 differs by ~1e-7); None if equal or if the model has no checkpointing."""
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    scale = max(g.abs().max().item() for g in ref.values())  # (a key bias's gradient is 0 up to rounding)
    for reentrant in (True, False):
        model.zero_grad(set_to_none=True)
        try:
            _enable_checkpointing(model, reentrant)
        except ValueError:  # does not support checkpointing
            return None
        torch.manual_seed(1)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        how = "reentrant" if reentrant else "non-reentrant"
        if got.keys() != ref.keys():
            return f"under {how} checkpointing, other parameters get gradients"
        if bf16:
            cos = _grad_cosine([got[n] for n in ref], ref.values())
            if cos < 0.999:
                return f"under {how} checkpointing, the gradients differ (cosine {cos:.4f})"
            continue
        for n, g in ref.items():
            if (got[n] - g).abs().max() > 1e-5 * g.abs().max() + 1e-6 * scale:
                return f"under {how} checkpointing, {n}'s gradient differs"
    (model.activation_checkpointing_disable if hasattr(model, "activation_checkpointing_disable")
     else model.gradient_checkpointing_disable)()
    return None


def check_titans(family: str, vision: bool = False, bf16: bool = False) -> tuple[str, str]:
    """Titans injection (``patch_model(titans=...)`` on the last decoder layer, memory only): the patched model's
    logits equal the original's at step 0, bit for bit; with the memory switched on, a training forward gives every
    memory parameter a finite gradient (some non-zero), the same under gradient checkpointing (reentrant and not);
    and a cached forward (prompt, then one token per call) equals the uncached one, where the unpatched model's own
    cache does (else ``exact, uncached``: trained and checked without a cache only). ``bf16``: the model in bf16,
    the gradients compared by cosine (:func:`_checkpointed_titans_differs`), the caches at 3e-2 instead of 1e-4."""
    import memgrad_hf
    from memgrad_hf.patches.titans import titans_branches
    from memgrad_hf.titans import TitansConfig

    try:
        model = (_tiny_vision(family) if vision else _tiny(family)).eval()
    except Exception as e:
        return "untested", f"tiny config: {_why(e, 90)}"
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else 101
    ids = torch.randint(3, min(vocab, 101), (2, 10), generator=torch.Generator().manual_seed(0))
    cache_tol = 3e-2 if bf16 else 1e-4
    try:
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False).logits.clone()
    except Exception as e:
        return "untested", f"unpatched model fails on the tiny config: {_why(e, 80)}"
    try:  # does the unpatched model's cache reproduce its own uncached logits? Asked in fp32, where 1e-4 can tell:
        # bf16's tolerance would pass a cache that is off by itself (roformer's, 1e-2 of its logits)
        with torch.no_grad():
            own = _incremental_logits(model, ids, 6)
        has_cache = bool(torch.allclose(own, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()))
    except Exception:
        has_cache = False
    if bf16:
        try:
            model = model.to(torch.bfloat16)
            with torch.no_grad():
                ref = model(input_ids=ids, use_cache=False).logits.clone()
        except Exception as e:
            return "untested", f"unpatched model fails in bf16 on the tiny config: {_why(e, 70)}"
    try:
        memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[-1], heads=2, chunk_size=4))
        with torch.no_grad():
            if not torch.equal(model(input_ids=ids, use_cache=False).logits, ref):
                return "MISMATCH", "step 0: the patched model's logits differ from the original's"
            branches = list(titans_branches(model).values())
            g = torch.Generator().manual_seed(3)
            for branch in branches:
                branch.out.weight.copy_(torch.randn(branch.out.weight.shape, generator=g).to(branch.out.weight.dtype)
                                        * 0.5)
        model.train()
        torch.manual_seed(1)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads = [p.grad for b in branches for p in b.parameters() if p.requires_grad]
        if all(q is None for q in grads):  # mllama: a cross-attention layer, skipped without an image
            return "untested", "the last decoder layer does not run in a text-only training forward"
        if not grads or any(q is None or not torch.isfinite(q).all() for q in grads):
            return "MISMATCH", "a memory parameter got no gradient or a non-finite one"
        if not any(q.abs().max() > 0 for q in grads):
            return "MISMATCH", "every memory gradient is zero"
        if (why := _checkpointed_titans_differs(model, ids, bf16)) is not None:
            return "MISMATCH", why
        model.eval()
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits
            if torch.allclose(full, ref, atol=1e-6):
                return "MISMATCH", "the switched-on memory does not reach the logits"
            if not has_cache:
                return "exact, uncached", f"{type(model).__name__} (the unpatched model's cache does not match)"
            try:
                inc = _incremental_logits(model, ids, 6)
            except memgrad_hf.UnsupportedModelError as e:
                return "exact, uncached", _brief(str(e))
    except memgrad_hf.UnsupportedModelError as e:
        return "unsupported", _brief(str(e))
    except Exception as e:
        return "ERROR", _brief(f"{type(e).__name__}: {e}")
    if not torch.allclose(inc, full, rtol=cache_tol, atol=cache_tol * full.abs().max().item()):
        return "MISMATCH", f"cached forward differs: {(inc - full).abs().max().item():.2e}"
    return "exact", type(model).__name__
