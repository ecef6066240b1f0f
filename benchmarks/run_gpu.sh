#!/usr/bin/env bash
# Every GPU check and benchmark behind benchmarks/RESULTS.md's GPU tables, part by part:
#   bash benchmarks/run_gpu.sh OUTDIR [part ...]   (default: checks titans titans-layer head grpo forge forge-profile)
# A session lent a GPU has 15 minutes of device time in all, the machine's start (~30 s) included: plan one call.
# Prepare here with `bash benchmarks/gpu_wheels.sh` (the packages the device image lacks, ~17 MB in .whl/), then one
# device call with carry [".whl"], timeout_s 600:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site || exit; bash benchmarks/run_gpu.sh $OUT host
# `host` is what is still open (issue 3's step time at ~1B, batch 1, without and with the Trainer's default clipping;
# carry only .whl, timeout_s 600: ~8 minutes expected, 10 if every step runs to its limit); `next` and `bnb` were
# run I's two calls.
# Each part writes OUTDIR/<part>.md; the exit status is non-zero if a check failed. Wall times seen on an H100: checks
# ~4 min, head ~2.5 per vocabulary, grpo ~3, titans > 4, forge ~5, forge-7b ~4, demo ~2, forge-profile ~2; each
# configuration under torch.compile compiles for ~60 s in its memory process and again in its timing one. What each
# run measured, and why each part exists, is in RESULTS.md (runs A-H).
set -u -o pipefail
out=${1:?usage: bash benchmarks/run_gpu.sh OUTDIR [checks titans titans-layer head grpo forge forge-profile]}
shift
parts=${*:-checks titans titans-layer head grpo forge forge-profile}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# `python tests/x.py` puts tests/ first on the path, not the repository: memgrad_hf must come from here as well
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
for part in $parts; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    checks)  # (a brace group in a pipeline runs in a subshell: its failures reach `status` through its exit code)
      { rc=0
        python tests/optim/_triton_twin_check.py cuda || rc=1
        python tests/titans/_triton_twin_check.py cuda || rc=1
        python tests/_head_triton_check.py cuda || rc=1
        python tests/gpu_checks.py || rc=1; exit $rc; } 2>&1 | tee "$out/checks.md" || status=1 ;;
    priority)  # issues 3-5's open GPU targets and the compiled-kernel checks, one call: each step under its own
      # time limit (seconds) so that one slow step cannot take the others' results with it (< 9.5 minutes in all)
      { rc=0
        timeout -k 5 60 python tests/optim/_triton_twin_check.py cuda || rc=1
        timeout -k 5 50 python tests/titans/_triton_twin_check.py cuda || rc=1
        timeout -k 5 60 python tests/_head_triton_check.py cuda || rc=1; exit $rc; } 2>&1 | tee "$out/checks.md" \
        || status=1
      timeout -k 5 100 python -m benchmarks.grpo --device cuda --repeats 10 --peers trl memgrad 2>&1 \
        | tee "$out/grpo.md" || status=1
      timeout -k 5 130 python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 \
        --batch 1 --seq 1024 --steps 5 --repeats 1 --configs adamw_torch_fused forge_lion forge_adamw+bf16_state \
        forge_adamw+8bit_state+head 2>&1 | tee "$out/forge.md" || status=1
      timeout -k 5 75 python -m benchmarks.titans --device cuda --repeats 10 --layers \
        --kernel-shapes 8x128x128x512 2>&1 | tee "$out/titans-d128.md" || status=1
      timeout -k 5 90 python -m benchmarks.titans --device cuda --repeats 5 --kernel-shapes 2>&1 \
        | tee "$out/titans-layer.md" || status=1 ;;
    next)  # the next session's call (after run H), < 8.5 minutes in all. Run H measured compiled forge_lion with
      # 8-bit state at 0.42x adamw_torch_fused's memory and 1.03x its median time over 4 timed steps, against a stock
      # step that spread from 60 to 82 ms: time it again with 10 steps (is it 1.03x, or within the noise of 0.9x?),
      # next to compiled stock (what compile alone buys) and to kernel=split (cuBLAS dW tiles: once compiled, is the
      # step device-bound, where the fused kernel's ~75-118 µs per 2048 x 2048 layer is the cost?). Peak memory is
      # read in the timing run (--in-process-memory): each compiled configuration compiles once, not twice (~60 s
      # each). Then FORGE's exact clipping on CUDA: compiled by inductor (with checkpointing + accumulation too) and
      # under patch_model(grad_in_forward=True|False), against AdamW + clip_grad_norm_, and forge_adamw in Trainer.
      timeout -k 5 330 python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 \
        --batch 1 --seq 1024 --steps 10 --repeats 1 --in-process-memory --configs adamw_torch_fused \
        adamw_torch_fused+compile forge_lion+8bit_state+compile forge_lion+8bit_state+split+compile 2>&1 \
        | tee "$out/forge-compile.md" || status=1
      timeout -k 5 150 python -c "import tests.gpu_checks as g; g.check_forge_exact_clipping(); g.check_forge_trainer()
raise SystemExit(len(g.FAILED))" 2>&1 | tee "$out/checks.md" || status=1 ;;
    host)  # the next call (after run I), < 9 minutes: issue 3's step time at ~1B, batch 1. Run I timed every
      # configuration without clipping (the benchmark's max_grad_norm=0 unless a configuration sets it): compiled
      # forge_lion 8-bit 1.13x adamw_torch_fused (split) / 1.40x (fused), device time 17.1 ms against stock's 19.2 in
      # a host-bound step, memgrad::forge_linear_backward 212 µs of host time per call. Its "grouped" call was
      # therefore the same code as the first (grouping then changed exact clipping's replay only; 1.40x there:
      # another machine). Here: the compiled kernels' checks (the one-tensor kernel's signature changed after run I;
      # the direct launch, new, against Triton's binding), host µs per launch both ways, run I's pair again (no
      # clipping) plus grouped small updates (MEMGRAD_FORGE_GROUPED=1 now groups the norms' updates without
      # clipping too), then the Trainer's default clipping on both sides, FORGE's replay with one launch per tensor
      # and grouped, in one process; then where a step's host time goes (cProfile of one compiled step without
      # clipping, Triton's launcher included). Each step under its own limit (s); ~9.5 minutes if every one runs
      # to its limit.
      timeout -k 5 50 python tests/optim/_triton_twin_check.py cuda 2>&1 | tee "$out/checks.md" || status=1
      timeout -k 5 60 python tests/optim/_triton_group_check.py cuda 2>&1 | tee -a "$out/checks.md" || status=1
      # (the head kernels' -inf-logit and NaN-row fixes of 2026-11-28, compiled; the twin check above has fp16 weights)
      timeout -k 5 60 python tests/_head_triton_check.py cuda 2>&1 | tee -a "$out/checks.md" || status=1
      # host µs per FORGE launch with triton_launch's direct launch (new) and with Triton's binding, a tiny layer
      timeout -k 5 30 python -m benchmarks.forge_launch --out 256 --in 256 --tokens 64 --calls 300 2>&1 \
        | tee "$out/forge-launch.md" || status=1
      timeout -k 5 170 python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 \
        --batch 1 --seq 1024 --steps 8 --repeats 1 --in-process-memory --configs adamw_torch_fused \
        forge_lion+8bit_state+split+compile forge_lion+8bit_state+split+compile+grouped 2>&1 \
        | tee "$out/forge-noclip.md" || status=1
      timeout -k 5 170 python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 \
        --batch 1 --seq 1024 --steps 8 --repeats 1 --in-process-memory --configs adamw_torch_fused+clip \
        forge_lion+8bit_state+split+compile+clip forge_lion+8bit_state+split+compile+clip+grouped 2>&1 \
        | tee "$out/forge-clip.md" || status=1
      timeout -k 5 70 python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 \
        --batch 1 --seq 1024 --steps 4 --repeats 1 --host-profile --configs forge_lion+8bit_state+split+compile \
        2>&1 | tee "$out/forge-host-profile.md" || status=1 ;;
    bnb)  # a second call straight after `next` on the warm machine, whose /tmp/site is kept: `next`'s call carries
      # [".whl", ".whl_bnb"] (`gpu_wheels.sh --bnb-only`: bitsandbytes alone, 42 MB; 61 MB in all with .whl/) and
      # installs both; this one carries nothing and begins with `export PYTHONPATH=/tmp/site`. The adamw_bnb_8bit
      # peer, never run on a GPU, beside FORGE's 8-bit state at batch 1 (issue 3's memory target; run H: 0.42x)
      timeout -k 5 130 python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 \
        --batch 1 --seq 1024 --steps 5 --repeats 1 --configs adamw_torch_fused adamw_bnb_8bit \
        forge_lion+8bit_state+head forge_adamw+8bit_state+head 2>&1 | tee "$out/forge-8bit.md" || status=1 ;;
    now)  # run H (2026-11-27, 900 s of device time): issue 5's medians first, the compiled twin checks, then issue
      # 3's time target under torch.compile (the configurations that can reach it), < 9.3 minutes
      timeout -k 5 90 python tests/titans/_triton_twin_check.py cuda 2>&1 | tee "$out/checks.md" || status=1
      timeout -k 5 140 python -m benchmarks.titans --device cuda --repeats 15 --layers --kernel-shapes 48x128x64x256 \
        8x128x64x256 8x128x128x512 8x128x256x1024 2>&1 | tee "$out/titans-kernels.md" || status=1
      timeout -k 5 60 python tests/optim/_triton_twin_check.py cuda 2>&1 | tee -a "$out/checks.md" || status=1
      timeout -k 5 25 python -c "import tests.gpu_checks as g; g.check_forge_host_waits(); raise SystemExit(len(g.FAILED))" \
        2>&1 | tee -a "$out/checks.md" || status=1
      timeout -k 5 230 python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 \
        --batch 1 --seq 1024 --steps 5 --repeats 1 --configs adamw_torch_fused adamw_torch_fused+compile \
        forge_lion+8bit_state+compile forge_adamw+bf16_state+compile 2>&1 | tee "$out/forge-compile.md" || status=1 ;;
    now2)  # straight after `now` on the warm machine: issue 3's memory target at batch 1, then the end-to-end checks
      timeout -k 5 120 python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 \
        --batch 1 --seq 1024 --steps 5 --repeats 1 --configs adamw_torch_fused forge_lion+8bit_state+head \
        forge_adamw+8bit_state+head 2>&1 | tee "$out/forge-8bit.md" || status=1
      timeout -k 5 90 python tests/gpu_checks.py 2>&1 | tee "$out/gpu-checks.md" || status=1 ;;
    next2)  # after `next`, in the same session if >= 300 s of device time are left (issue 3's memory target at
      # batch 1 without checkpointing, <= 0.55x adamw_torch_fused: Lion's one moment in 8-bit codes; and the
      # adamw_bnb_8bit peer, never run on a GPU), then every end-to-end GPU check (the new host-waits check included)
      timeout -k 5 130 python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 \
        --batch 1 --seq 1024 --steps 5 --repeats 1 --configs adamw_torch_fused forge_lion+8bit_state+head \
        forge_adamw+8bit_state+head adamw_bnb_8bit 2>&1 | tee "$out/forge-8bit.md" || status=1
      timeout -k 5 90 python tests/gpu_checks.py 2>&1 | tee "$out/gpu-checks.md" || status=1
      timeout -k 5 50 python -m benchmarks.forge_host --device cuda --configs adamw_torch_fused forge_adamw \
        adamw_torch_fused+compile forge_adamw+compile 2>&1 | tee "$out/launch.md" || status=1 ;;
    confirm)  # a second short call: GRPO with more repeats, the Titans kernel table at every shape, the head at 128256
      timeout -k 5 70 python -m benchmarks.grpo --device cuda --repeats 30 --peers trl memgrad 2>&1 \
        | tee "$out/grpo-confirm.md" || status=1
      timeout -k 5 140 python -m benchmarks.titans --device cuda --repeats 15 --layers --kernel-shapes 48x128x64x256 \
        8x128x64x256 8x128x128x512 8x128x256x1024 2>&1 | tee "$out/titans-kernels.md" || status=1
      timeout -k 5 100 python -m benchmarks.head --device cuda --repeats 10 --vocab 128256 2>&1 \
        | tee "$out/head-128k.md" || status=1 ;;
    titans) python -m benchmarks.titans --device cuda --repeats 10 --layers 2>&1 | tee "$out/titans.md" ;;
    titans-layer) python -m benchmarks.titans --device cuda --repeats 5 --kernel-shapes 2>&1 \
      | tee "$out/titans-layer.md" ;;
    titans-d128)  # the second kernel target (>= 6.1x vmap(grad) at dim_head 128) alone
      python -m benchmarks.titans --device cuda --repeats 10 --layers --kernel-shapes 8x128x128x512 2>&1 \
      | tee "$out/titans-d128.md" ;;
    head-128k) python -m benchmarks.head --device cuda --repeats 10 --vocab 128256 2>&1 | tee "$out/head-128k.md" ;;
    launch)  # host µs per launch: Triton (empty, and memgrad's kernels at tiny sizes) against torch ops (~10 s);
      # FORGE's Python per linear layer and step, its kernels no-ops, against nn.Linear + fused AdamW (~20 s)
      { python -m benchmarks.launch_overhead
        python -m benchmarks.forge_host --device cuda; } 2>&1 | tee "$out/launch.md" ;;
    head) python -m benchmarks.head --device cuda --repeats 10 2>&1 | tee "$out/head.md" ;;
    grpo) { python -m benchmarks.grpo --device cuda --repeats 10
        python -m benchmarks.grpo --device cuda --repeats 5 --peers trl memgrad --outputs sft; } 2>&1 \
        | tee "$out/grpo.md" ;;
    head-profile)  # where the head's time goes on the GPU, per peer (top kernels by device time, host syncs)
      { python -m benchmarks.head --device cuda --vocab 128256 --repeats 3 --profile --peers trl liger memgrad \
          memgrad_recompute
        python -m benchmarks.grpo --device cuda --repeats 3 --profile --peers trl memgrad; } 2>&1 \
        | tee "$out/head-profile.md" ;;
    forge)  # ~1B Llama-style model, bf16 weights, batch 1 x 1024 tokens
      python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 --batch 1 \
        --seq 1024 --steps 6 --repeats 1 --configs adamw_torch_fused adamw_bnb_8bit forge_adamw+bf16_state \
        forge_adamw+8bit_state forge_lion forge_adamw+8bit_state+head adamw_torch_fused+gc \
        forge_adamw+bf16_state+head+gc forge_adamw+8bit_state+head+gc forge_sgd+head adamw_torch_fused+clip \
        forge_adamw+bf16_state+clip forge_adamw+bf16_state+clip_backward adamw_torch_fused+head+clip \
        forge_adamw+bf16_state+head+clip 2>&1 | tee "$out/forge.md" ;;
    forge-profile)  # where a step's time goes (top kernels by device time, host syncs)
      python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 --batch 1 \
        --seq 1024 --steps 4 --repeats 1 --profile --configs adamw_torch_fused forge_lion forge_adamw+bf16_state \
        2>&1 | tee "$out/forge-profile.md" ;;
    forge-7b)  # Llama-2-7B-shaped (6.7B params, bf16), batch 1 x 1024: the scale of the FORGE paper's claims, where
      # a step is device-bound (the 941M model above is host-bound at batch 1); not yet run. First one MLP-sized
      # layer (11008 x 4096): fused kernel tiles and kernel=split tile sizes
      python -m benchmarks.forge_launch --out 11008 --in 4096 --calls 50 --sweep 2>&1 | tee "$out/forge-7b-layer.md"
      python -m benchmarks.forge --device cuda --bf16 --hidden 4096 --layers 32 --vocab 32000 --batch 1 \
        --seq 1024 --steps 5 --repeats 1 --configs adamw_torch_fused forge_lion forge_lion+fused forge_lion+split16 \
        forge_adamw+bf16_state forge_adamw+8bit_state+head 2>&1 | tee "$out/forge-7b.md" ;;
    forge-compile)  # the same ~1B model with torch_compile=True for both (fewer host launches per step)
      python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 --batch 1 \
        --seq 1024 --steps 6 --repeats 1 --configs adamw_torch_fused+compile forge_lion+compile forge_lion+split+compile 2>&1 \
        | tee "$out/forge-compile.md" ;;
    forge-host)  # host time per FORGE layer vs device time, and a cProfile of one step (is a step host-bound?)
      { python -m benchmarks.forge_host --device cuda
        python -m benchmarks.forge_launch --sweep
        python -m benchmarks.forge_launch --out 256 --in 256 --tokens 64  # device time ~nil: the host cost alone
        python -m benchmarks.forge --device cuda --bf16 --hidden 2048 --layers 16 --vocab 32000 --batch 1 \
          --seq 1024 --steps 4 --repeats 1 --host-profile --configs adamw_torch_fused forge_lion; } 2>&1 \
        | tee "$out/forge-host.md" ;;
    demo)  # the user's view: HF Trainer end to end, stock vs patch_model vs + forge_adamw, Llama-3-sized vocabulary
      python -m memgrad_hf.cli demo --bf16 --vocab 128256 --hidden 2048 --layers 4 --batch 4 --seq 1024 --steps 10 2>&1 \
        | tee "$out/demo.md" ;;
    masked-lm)  # ModernBERT-base-shaped masked LM (768 x 22 layers, vocab 50368), Trainer, bf16 autocast, 30% targets
      python -m benchmarks.masked_lm --device cuda --bf16 --hidden 768 --layers 22 --batch 16 --seq 1024 --steps 3 \
        --repeats 3 2>&1 | tee "$out/masked-lm.md" ;;
    evaluate) python -m benchmarks.evaluate --device cuda --vocab 128256 --hidden 1024 --seq 1024 --rows 32 \
        --repeats 5 2>&1 | tee "$out/evaluate.md" ;;
    *) echo "unknown part $part"; status=1 ;;
  esac
done
exit $status
