"""Run under TRITON_INTERPRET=1 MEMGRAD_BACKEND=triton (by test_forge_triton.py): forge_adamw in HF Trainer with
exact clipping, every update through the Triton kernels (fused linears: ``linear_weight_step``, or with
optim_args kernel=split ``linear_weight_step_split``; embeddings, norms:
``update_step``), against adamw_torch. Prints the kernel call counts and the largest relative weight difference."""

import copy
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import memgrad_hf  # noqa: E402,F401  (registers forge_*)
from memgrad_hf.kernels import forge_triton as T  # noqa: E402
from tests.optim.test_forge_trainer import _args, _train  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402


def main() -> int:
    calls = {"linear_weight_step": 0, "linear_weight_step_split": 0, "update_step": 0}
    for name in calls:
        original = getattr(T, name)

        def counted(*a, _f=original, _n=name, **k):
            calls[_n] += 1
            return _f(*a, **k)

        setattr(T, name, counted)
    ok = True
    for kernel in ("fused", "split"):  # the fused kernel, then cuBLAS tiles + the update kernel (optim_args kernel=)
        model = tiny_model("llama")
        ref = copy.deepcopy(model)
        with tempfile.TemporaryDirectory() as tmp:
            # small tiles: the embedding is updated in several row blocks
            forge = _args(Path(tmp) / "f", "forge_adamw", max_grad_norm=0.05,
                          optim_args=f"tile_bytes=4096,kernel={kernel}")
            _, la, ga = _train(model, forge)
            _, lb, gb = _train(ref, _args(Path(tmp) / "r", "adamw_torch", max_grad_norm=0.05))
        pairs = zip(model.parameters(), ref.parameters(), strict=True)
        err = max(((p - q).abs().max() / q.abs().max()).item() for p, q in pairs)
        print(f"kernel={kernel}: kernel calls {calls}; losses {la} vs {lb}; grad norms {ga} vs {gb}; max relative "
              f"weight error {err:.2e}")
        ok &= err < 1e-5 and max(abs(a - b) / b for a, b in zip(la, lb, strict=True)) < 1e-5
    ok &= all(calls.values())
    # what a GPU user gets by default: the chunked head on its Triton kernels handing the head weight's gradient to
    # FORGE in vocabulary blocks, against the unpatched model under adamw_torch
    from memgrad_hf.kernels import head_triton as H

    stats_calls, block_calls = [], []
    original_stats, original_blocks = H.head_stats, H.head_backward_vocab_blocks
    H.head_stats = lambda *a, **k: stats_calls.append(1) or original_stats(*a, **k)
    H.head_backward_vocab_blocks = lambda *a, **k: block_calls.append(1) or original_blocks(*a, **k)
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model, chunk_size=5)  # several chunks (and a partial one) of the 2 x 16 tokens
    with tempfile.TemporaryDirectory() as tmp:
        _, la, _ = _train(model, _args(Path(tmp) / "f", "forge_adamw", max_grad_norm=0.05))
        _, lb, _ = _train(ref, _args(Path(tmp) / "r", "adamw_torch", max_grad_norm=0.05))
    pairs = zip(model.parameters(), ref.parameters(), strict=True)
    err_head = max(((p - q).abs().max() / q.abs().max()).item() for p, q in pairs)
    print(f"patch_model + forge_adamw (Triton head and updates): {len(stats_calls)} Triton head_stats calls, "
          f"{len(block_calls)} Triton vocabulary-block backward calls; losses {la} vs {lb}; max relative weight error "
          f"{err_head:.2e}")
    ok &= len(stats_calls) > 0 and len(block_calls) > 0 and err_head < 1e-5
    ok &= max(abs(a - b) / b for a, b in zip(la, lb, strict=True)) < 1e-5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
