"""Full Trainer steps with FORGE vs. stock optimizers, side by side (``memgrad-hf bench forge``).

A Llama-style model (~60M parameters, fp32 on CPU; pass a bigger config and --bf16 on GPU) trained with HF
``Trainer`` for a few steps per optimizer. Peak memory: one fresh process per configuration, the peak a training run
adds over the loaded model (optimizer state included). Time per step: configurations interleaved round-robin in
this process (each run builds a fresh Trainer).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch

from benchmarks.harness import (
    Case,
    bench_parser,
    host_waits,
    machine,
    peak_added_mib,
    time_interleaved,
    versions,
    warm_libraries,
)
from memgrad_hf import memory

CONFIGS = {
    "adamw_torch": dict(optim="adamw_torch"),
    "adamw_torch_fused": dict(optim="adamw_torch_fused"),
    "adalomo": dict(optim="adalomo"),
    "adamw_bnb_8bit": dict(optim="adamw_bnb_8bit"),  # GPU, with bitsandbytes installed
    "forge_adamw": dict(optim="forge_adamw"),
    "forge_adamw+bf16_state": dict(optim="forge_adamw", optim_args="state_dtype=bf16"),
    "forge_adamw+8bit_state": dict(optim="forge_adamw", optim_args="state_dtype=8bit"),
    "forge_lion": dict(optim="forge_lion"),
    # plain SGD (no state): torch, LOMO (SGD fused into backward per whole parameter, lomo-optim) and FORGE
    "sgd": dict(optim="sgd"),
    "lomo": dict(optim="lomo"),
    "forge_sgd": dict(optim="forge_sgd"),
    "forge_sgd+head": dict(optim="forge_sgd", patch=True),
    # the Trainer's default max_grad_norm=1.0; exact clipping by replay (default) or by a second backward
    "forge_adamw+clip": dict(optim="forge_adamw", max_grad_norm=1.0),
    "forge_adamw+clip_backward": dict(optim="forge_adamw", max_grad_norm=1.0, optim_args="clip_pass=backward"),
    "adamw_torch+clip": dict(optim="adamw_torch", max_grad_norm=1.0),
    "forge_adamw+head+clip": dict(optim="forge_adamw", max_grad_norm=1.0, patch=True),
    "adamw_torch+head+clip": dict(optim="adamw_torch", max_grad_norm=1.0, patch=True),
    "adamw_torch_fused+clip": dict(optim="adamw_torch_fused", max_grad_norm=1.0),
    "adamw_torch_fused+head+clip": dict(optim="adamw_torch_fused", max_grad_norm=1.0, patch=True),
    "forge_adamw+bf16_state+head+clip": dict(optim="forge_adamw", optim_args="state_dtype=bf16", max_grad_norm=1.0,
                                             patch=True),
    "forge_adamw+bf16_state+clip": dict(optim="forge_adamw", optim_args="state_dtype=bf16", max_grad_norm=1.0),
    "forge_adamw+bf16_state+clip_backward": dict(optim="forge_adamw", max_grad_norm=1.0,
                                                 optim_args="state_dtype=bf16,clip_pass=backward"),
    # with memgrad_hf.patch_model: the chunked head hands its weight gradient to FORGE in vocabulary blocks
    "adamw_torch+head": dict(optim="adamw_torch", patch=True),
    "forge_adamw+head": dict(optim="forge_adamw", patch=True),
    "forge_adamw+head_hold": dict(optim="forge_adamw", optim_args="head_grad=hold", patch=True),
    "forge_adamw+bf16_state+head": dict(optim="forge_adamw", optim_args="state_dtype=bf16", patch=True),
    "forge_lion+head": dict(optim="forge_lion", patch=True),
    "forge_adamw+8bit_state+head": dict(optim="forge_adamw", optim_args="state_dtype=8bit", patch=True),
    # Lion's one moment in 8-bit codes: a quarter of bf16 AdamW's state bytes
    "forge_lion+8bit_state": dict(optim="forge_lion", optim_args="state_dtype=8bit"),
    "forge_lion+8bit_state+head": dict(optim="forge_lion", optim_args="state_dtype=8bit", patch=True),
    # gradient checkpointing (activations recomputed in backward): what is left is weights, state and gradients
    "adamw_torch_fused+gc": dict(optim="adamw_torch_fused", activation_checkpointing=True),
    "forge_adamw+bf16_state+head+gc": dict(optim="forge_adamw", optim_args="state_dtype=bf16", patch=True,
                                           activation_checkpointing=True),
    "forge_adamw+8bit_state+head+gc": dict(optim="forge_adamw", optim_args="state_dtype=8bit", patch=True,
                                           activation_checkpointing=True),
    # optim_args kernel=split (GPU): dW tiles by cuBLAS, then the update kernel, instead of the fused Triton kernel
    # (the default "auto" picks split for weights of 4096 x 4096 elements and more)
    "forge_lion+split": dict(optim="forge_lion", optim_args="kernel=split"),
    "forge_lion+fused": dict(optim="forge_lion", optim_args="kernel=fused"),  # the default below 4096 x 4096
    "forge_lion+split16": dict(optim="forge_lion", optim_args=f"kernel=split,tile_bytes={16 << 20}"),  # L2-sized
    "forge_adamw+bf16_state+split": dict(optim="forge_adamw", optim_args="state_dtype=bf16,kernel=split"),
    # Trainer(torch_compile=True): fewer host launches per step, which is what bounds a ~1B model at batch 1
    "adamw_torch_fused+compile": dict(optim="adamw_torch_fused", torch_compile=True),
    "forge_lion+compile": dict(optim="forge_lion", torch_compile=True),
    "forge_adamw+compile": dict(optim="forge_adamw", torch_compile=True),
    "forge_lion+split+compile": dict(optim="forge_lion", optim_args="kernel=split", torch_compile=True),
    "forge_adamw+bf16_state+compile": dict(optim="forge_adamw", optim_args="state_dtype=bf16", torch_compile=True),
    "forge_lion+8bit_state+compile": dict(optim="forge_lion", optim_args="state_dtype=8bit", torch_compile=True),
    "forge_lion+8bit_state+split+compile": dict(optim="forge_lion", optim_args="state_dtype=8bit,kernel=split",
                                                torch_compile=True),
    # MEMGRAD_FORGE_GROUPED=1 for the run (experimental): without clipping the norms' and biases' updates go out in one
    # launch as each backward ends; with the Trainer's default clipping (exact, by replay), the replay's updates too
    "forge_lion+8bit_state+split+compile+grouped": dict(
        optim="forge_lion", optim_args="state_dtype=8bit,kernel=split", torch_compile=True, grouped=True),
    "forge_lion+8bit_state+split+compile+clip": dict(optim="forge_lion", optim_args="state_dtype=8bit,kernel=split",
                                                     torch_compile=True, max_grad_norm=1.0),
    "forge_lion+8bit_state+split+compile+clip+grouped": dict(
        optim="forge_lion", optim_args="state_dtype=8bit,kernel=split", torch_compile=True, max_grad_norm=1.0,
        grouped=True),
}
_NOT_TRAINING_ARGS = ("patch", "grouped")  # configuration keys that are not TrainingArguments


def llama_config(vocab: int, hidden: int, layers: int, max_positions: int):
    """The benchmarks' Llama-style shape: Llama's MLP ratio (2.6875, rounded to 16), heads of 64."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875) // 16 * 16,
                       num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
                       num_key_value_heads=max(hidden // 64, 1), max_position_embeddings=max_positions)


def setup(device: str, config: str, hidden: int, layers: int, vocab: int, batch: int, seq: int, steps: int,
          bf16: bool) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    import memgrad_hf  # registers forge_*

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = llama_config(vocab, hidden, layers, max(seq, 128))
    with torch.device(device):  # built where it trains: a 1B model's init on the host would dominate the run
        model = LlamaForCausalLM(cfg)
    if bf16:
        model = model.to(torch.bfloat16)
    if CONFIGS[config].get("patch"):
        memgrad_hf.patch_model(model)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, vocab, (seq,), generator=g).tolist()), "labels": ids}
            for _ in range(batch * steps)]
    return {"model": model, "data": data, "config": config, "batch": batch, "steps": steps, "device": device}


STEP_TIMES: dict[str, list[float]] = {}  # config -> seconds of every step after each run's first (timing runs)
# --in-process-memory (GPU): config -> peak MiB the first timing run added over what was allocated when it began
PEAK_IN_RUN: dict[str, float] = {}


def _setup_measured(**kw) -> dict:
    """:func:`setup` for ``--in-process-memory``: the run reads its own peak."""
    return {**setup(**kw), "measure_memory": True}


def _step_profiler(config: str, device: str, last_step: int, host: bool = False):
    """Profiles the run's last step and prints where its time went: ``torch.profiler``'s top ops (device time on a
    GPU) and the number of host syncs, or with ``host`` a cProfile of the Python side (on a GPU a step is
    host-bound when that total exceeds the device time)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    cuda = device.startswith("cuda")

    def report(prof) -> str:
        if host:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            return f"\n### host profile of one step: {config}\n\n```\n{buf.getvalue().strip()}\n```"
        ev = prof.key_averages()
        table = ev.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=15)
        return f"\n### profile of one step: {config} ({host_waits(ev, cuda)})\n\n{table}"

    class StepProfiler(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == last_step - 1:
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                self.prof = cProfile.Profile() if host else profile(activities=acts)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kw):
            if getattr(self, "prof", None) is None:
                return
            if cuda:
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            print(report(self.prof))
            self.prof = None

    return StepProfiler()


def _step_timer(config: str, sync: bool):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Times each optimizer step (forward, backward, update); the first step of a run (allocator warm-up,
        kernel compilation) is left out."""

        def on_step_begin(self, args, state, control, **kw):
            if sync:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if sync:
                torch.cuda.synchronize()
            if state.global_step > 1:
                STEP_TIMES.setdefault(config, []).append(time.perf_counter() - self.t0)

    return StepTimer()


def run(s: dict) -> None:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    kw = dict(output_dir="/tmp/memgrad_bench_forge", max_steps=s["steps"], per_device_train_batch_size=s["batch"],
              learning_rate=1e-4, logging_steps=10_000, save_strategy="no", report_to="none",
              use_cpu=not s["device"].startswith("cuda"), dataloader_num_workers=0, disable_tqdm=True,
              max_grad_norm=0.0, seed=0)
    kw.update({k: v for k, v in CONFIGS[s["config"]].items() if k not in _NOT_TRAINING_ARGS})
    t = Trainer(model=s["model"], args=TrainingArguments(**kw), train_dataset=s["data"])
    t.remove_callback(PrinterCallback)
    t.add_callback(_step_timer(s["config"], s["device"].startswith("cuda")))
    if s.get("profile"):
        t.add_callback(_step_profiler(s["config"], s["device"], s["steps"]))
    if s.get("host_profile"):
        t.add_callback(_step_profiler(s["config"], s["device"], s["steps"], host=True))
    measure = s.get("measure_memory") and s["config"] not in PEAK_IN_RUN
    if measure:
        gc.collect()
        if s["device"].startswith("cuda"):
            torch.cuda.synchronize()
        base = memory.current_bytes(s["device"])
        memory.reset_peak(s["device"])
    grouped = os.environ.get("MEMGRAD_FORGE_GROUPED")
    if CONFIGS[s["config"]].get("grouped"):
        os.environ["MEMGRAD_FORGE_GROUPED"] = "1"
    try:
        t.train()
    finally:
        if grouped is None:
            os.environ.pop("MEMGRAD_FORGE_GROUPED", None)
        else:
            os.environ["MEMGRAD_FORGE_GROUPED"] = grouped
    if measure:
        PEAK_IN_RUN[s["config"]] = mib = (memory.peak_bytes(s["device"]) - base) / memory.MiB
        print(f"# peak added, {s['config']}: {mib:.0f} MiB", flush=True)  # (a run stopped by its limit keeps it)
    opt = getattr(t.optimizer, "optimizer", t.optimizer)
    if hasattr(opt, "detach"):
        opt.detach()  # the next run's Trainer builds its own optimizer


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("forge", __doc__, hidden=512, layers=8, vocab=32000, batch=2, seq=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bf16", action="store_true", help="bf16 model weights")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG",
                   help="configurations to run (default: all): " + ", ".join(CONFIGS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true",
                   help="after the table, run each configuration once more and profile its last step")
    p.add_argument("--host-profile", action="store_true",
                   help="after the table, run each configuration once more and cProfile its last step (host time)")
    p.add_argument("--in-process-memory", action="store_true",
                   help="GPU: read each configuration's peak memory (the allocator's counters) during its first "
                        "timing run instead of in a fresh process first; a configuration under torch.compile then "
                        "compiles once instead of twice (~60 s each at ~1B)")
    a = p.parse_args(argv)
    if a.in_process_memory and not a.device.startswith("cuda"):
        p.error("--in-process-memory needs a GPU's allocator counters (on CPU peak RSS only grows: fresh processes)")
    torch.set_num_threads(a.threads)
    kw = dict(hidden=a.hidden, layers=a.layers, vocab=a.vocab, batch=a.batch, seq=a.seq, steps=a.steps, bf16=a.bf16)
    cases = [Case(c, _setup_measured if a.in_process_memory else setup, run, dict(config=c, **kw))
             for c in a.configs]
    with torch.device("meta"):
        n_params = sum(p.numel() for p in setup("meta", a.configs[0], **{**kw, "steps": 0})["model"].parameters())
    print(f"# Trainer, Llama-style {n_params / 1e6:.1f}M params, {a.steps} steps of {a.batch}x{a.seq} tokens, "
          f"{'bf16' if a.bf16 else 'fp32'} weights, {a.device}")
    print(f"# {machine(a.device)}; {versions()}\n")
    mem = {}
    if a.in_process_memory:
        warm_libraries(a.device)  # cuBLAS's workspaces exist before the first configuration's peak is read
    else:
        for c in cases:  # printed as measured: a run stopped by its time limit still reports these
            mem[c.name] = m = peak_added_mib(c, a.device, a.threads)
            print(f"# peak added, {c.name}: " + (f"{m['added_mib']:.0f} MiB" if m["ok"] else str(m.get("error"))),
                  flush=True)
    # one model alive at a time (steps are timed inside each run, set-up is not)
    time_interleaved(cases, a.device, repeats=a.repeats, warmup=0, lazy=True)
    for name, mib in PEAK_IN_RUN.items():
        mem[name] = {"ok": True, "added_mib": mib}
    # the reference: adamw_torch, else (GPU runs) adamw_torch_fused
    ref = next((r for r in ("adamw_torch", "adamw_torch_fused") if r in a.configs), "adamw_torch")
    base_m = mem.get(ref)
    base_t = statistics.median(STEP_TIMES[ref]) if STEP_TIMES.get(ref) else None
    print(f"| optimizer | peak added (MiB) | vs {ref} | s/step (min / median) | vs {ref} |")
    print("|---|---:|---:|---:|---:|")
    for c in cases:
        m, t = mem.get(c.name, {"ok": False, "error": "no run finished"}), STEP_TIMES.get(c.name)
        if not m["ok"] or not t:
            print(f"| {c.name} | — | | {m.get('error') if not m['ok'] else 'no timed step'} | |")
            continue
        med = statistics.median(t)
        rm = f"{m['added_mib'] / base_m['added_mib']:.2f}x" if base_m and base_m["ok"] else ""
        rt = f"{med / base_t:.2f}x" if base_t else ""
        print(f"| {c.name} | {m['added_mib']:.0f} | {rm} | {min(t):.3f} / {med:.3f} | {rt} |", flush=True)
    if a.profile:
        for c in cases:
            run({**setup(a.device, c.name, **kw), "profile": True})
    if a.host_profile:
        for c in cases:
            run({**setup(a.device, c.name, **kw), "host_profile": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
