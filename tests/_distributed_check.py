"""Run by test_distributed.py under ``torch.distributed.run --nproc_per_node 2`` (CPU, gloo): memgrad under DDP
(HF ``Trainer``) and FSDP (a plain loop).

1. A tiny Llama trained 3 SGD steps stock, then from the same seed with ``patch_model`` (the chunked head): the
   ranks hold different numbers of ``-100`` labels, so the Trainer's cross-rank ``num_items_in_batch`` matters;
   logged losses and final weights must equal the stock run's (SGD: a weight difference is a gradient difference,
   not one that Adam's normalisation magnifies).
2. The same with a Titans memory branch (``patch_model(titans=...)``), AdamW: it trains under DDP with
   ``ddp_find_unused_parameters=False`` (DDP would fail if a parameter got no gradient), its memory parameters
   move and the ranks end with identical weights.
3. ``optim="forge_adamw"`` is refused with the error that names the limitation; so is a FORGE optimizer built
   before the process group started, given to the Trainer or trained in a loop under DDP.
4. FSDP2 (``fully_shard`` per decoder layer and the root) and FSDP1 (``FullyShardedDataParallel``, decoder-layer
   auto-wrap), tied and untied heads: 3 SGD steps patched equal stock. An ``lm_head`` sharded as its own FSDP2 unit
   is refused with ``UnsupportedModelError`` (it is only gathered around its own forward).
5. TRL's GRPOTrainer under DDP (loss ``dapo``, 3 steps), stock and with memgrad's fused head (``patch_trl``): logged
   losses and grad norms equal.

Rank 0 writes a JSON report to the path given as the first argument.
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

import memgrad_hf
from memgrad_hf import UnsupportedModelError
from memgrad_hf.optim import ForgeAdamW
from memgrad_hf.titans import TitansConfig

SEQ, N = 12, 16


def build(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


def dataset() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(N):
        ids = torch.randint(1, 101, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: 1 + (i * 5) % (SEQ - 2)] = -100  # a different number of prompt tokens per example
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def train(model: torch.nn.Module, out: str, optimizers: tuple = (None, None),
          **kw) -> tuple[list[float], dict[str, torch.Tensor]]:
    args = TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                             disable_tqdm=True, max_grad_norm=1.0, ddp_find_unused_parameters=False, **kw)
    t = Trainer(model=model, args=args, train_dataset=dataset(), optimizers=optimizers)
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(rel(a[n], b[n]) for n in b)


def rank_spread(params: dict[str, torch.Tensor]) -> float:
    """Largest difference of any weight between this rank and rank 0 (DDP keeps replicas identical)."""
    worst = 0.0
    for p in params.values():
        ref = p.clone()
        dist.broadcast(ref, 0)
        worst = max(worst, (p - ref).abs().max().item())
    t = torch.tensor(worst)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def fsdp_train(kind: str, tied: bool, patched: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """3 SGD steps of an FSDP-wrapped model on this rank's batch; the full weights after them."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = build(tied)
    if patched:
        memgrad_hf.patch_model(model)
    if kind == "fsdp1":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        model = FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True,
                                         device_id=torch.device("cpu"))
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        if kind == "fsdp2_own_head":
            fully_shard(model.lm_head)
        fully_shard(model)
    rows = dataset()[2 * dist.get_rank():2 * dist.get_rank() + 2]
    ids = torch.tensor([r["input_ids"] for r in rows])
    labels = torch.tensor([r["labels"] for r in rows])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if kind == "fsdp1":
        with FullyShardedDataParallel.summon_full_params(model):
            return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def main(report_path: str) -> None:
    hf_logging.set_verbosity_error()
    out = tempfile.mkdtemp()
    report: dict = {}
    assert not dist.is_initialized()  # FORGE optimizers built before the process group: the constructor cannot see it
    early = [build() for _ in range(2)]
    early_opts = [ForgeAdamW(m.parameters(), model=m, lr=1e-2) for m in early]
    stock_losses, stock = train(build(), out, optim="sgd")
    report["world_size"] = dist.get_world_size()
    model = memgrad_hf.patch_model(build())
    losses, params = train(model, out, optim="sgd")
    report["stock_losses"], report["patched_losses"] = stock_losses, losses
    report["head_weight_rel_err"] = max_rel(params, stock)
    report["head_rank_spread"] = rank_spread(params)
    model = memgrad_hf.patch_model(build(), titans=TitansConfig(layers=[1], heads=2, chunk_size=4))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "memory" in n}
    losses, params = train(model, out)
    report["titans_losses"] = losses
    report["titans_rank_spread"] = rank_spread(params)
    report["titans_params_moved"] = sum(not torch.equal(params[n], p) for n, p in before.items())
    report["titans_params"] = len(before)
    try:
        train(build(), out, optim="forge_adamw")
        report["forge_error"] = None
    except ValueError as e:
        report["forge_error"] = str(e)
    try:  # the Trainer given one built before the group: refused when train() starts
        train(early[0], out, optimizers=(early_opts[0], None))
        report["forge_early_trainer_error"] = None
    except ValueError as e:
        report["forge_early_trainer_error"] = str(e)
    ddp = torch.nn.parallel.DistributedDataParallel(early[1])  # a loop's DDP wrapper (Accelerator.prepare's too)
    batch = dataset()[2 * dist.get_rank()]
    try:  # refused at the first update, before any rank has changed a weight
        ddp(input_ids=torch.tensor([batch["input_ids"]]), labels=torch.tensor([batch["labels"]])).loss.backward()
        report["forge_early_loop_error"] = None
    except ValueError as e:
        report["forge_early_loop_error"] = str(e)
    report["forge_early_loop_unchanged"] = all(torch.equal(p, q) for p, q in zip(
        early[1].parameters(), build().parameters(), strict=True))
    for kind in ("fsdp1", "fsdp2"):
        for tied in (False, True):
            (l0, p0), (l1, p1) = fsdp_train(kind, tied, False), fsdp_train(kind, tied, True)
            report[f"{kind}_tied{tied}"] = {"loss_diff": max(abs(a - b) for a, b in zip(l0, l1, strict=True)),
                                            "weight_rel_err": max_rel(p1, p0), "rank_spread": rank_spread(p1)}
    try:
        fsdp_train("fsdp2_own_head", False, True)
        report["fsdp_own_head_error"] = None
    except UnsupportedModelError as e:
        report["fsdp_own_head_error"] = str(e)
    from pathlib import Path

    from tests.grpo.test_grpo_trainer import _run as grpo_run

    report["grpo_stock"] = grpo_run(Path(out) / "grpo_stock", "dapo", patched=False)
    report["grpo_patched"] = grpo_run(Path(out) / "grpo_patched", "dapo", patched=True)
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump(report, f)
    # an explicit teardown: a gloo group left to the interpreter's exit once aborted a rank after all was done
    # ("terminate called without an active exception", exit code -6)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1])
