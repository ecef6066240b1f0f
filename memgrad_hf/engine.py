"""What the autograd engine is doing in the backward running now, as the fused backwards need to know: whether it
accumulates into a parameter (a fused optimizer step applies only then) and whether it builds a graph of the
gradients (``create_graph=True``, which gradients computed by kernels cannot join)."""

from __future__ import annotations

from typing import Any

import torch

# set on a layer that runs several times per forward by design (a FAN, once per memory chunk): FORGE applies its summed
# gradient from the weight's gradient hook, as for any weight used twice, without the warning meant for accidents
REUSED_PER_FORWARD = "_memgrad_reused_per_forward"


def accumulates_into(node_ctx: Any, index: int) -> bool:
    """Whether the backward running ``node_ctx`` (an autograd Function's ``ctx``) accumulates into its input
    ``index`` (a parameter): true under ``loss.backward()``, false under ``torch.autograd.grad`` and for parameters
    left out of ``backward(inputs=...)``. An optimizer step fused into backward applies only then, as a torch
    optimizer would only see a ``.grad`` then; otherwise the gradient is returned to autograd."""
    node = node_ctx.next_functions[index][0]
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch.autograd.grad() on a leaf: it never accumulates into .grad
        return False


def refuse_func_transforms(what: str, fix: str) -> None:
    """Raise when called under ``torch.func.grad`` / ``vjp`` / ``jvp`` / ``vmap``: ``what`` is an autograd Function
    whose kernels write into preallocated buffers, which those transforms cannot trace (torch's own error names
    neither the function nor a way out). ``torch.func.functionalize``, as ``torch.compile`` uses it, is let
    through."""
    from torch._C._functorch import TransformType, peek_interpreter_stack

    top = peek_interpreter_stack()
    if top is not None and top.key() != TransformType.Functionalize:
        raise RuntimeError(
            f"memgrad_hf: {what} was called under torch.func ({top.key().name.lower()}), which its chunked kernels "
            f"do not support. {fix}"
        )


def refuse_create_graph(what: str, fix: str) -> None:
    """Raise inside a backward run with ``create_graph=True`` (a gradient penalty, MAML, Hessian-vector products):
    ``what`` computes its gradient with ops autograd cannot differentiate again, so the second-order terms would
    silently be wrong. ``fix`` says what to do instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"memgrad_hf: a backward with create_graph=True (a gradient penalty, MAML, Hessian-vector products) "
            f"through {what}: its gradient cannot be differentiated again, so the second-order terms would be "
            f"wrong. {fix}"
        )
