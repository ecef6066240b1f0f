"""CPU fast path for FORGE updates that keep reduced-precision state (bf16 or 8-bit) or bf16 weights: decoding the
state, the rule and re-encoding it (with the hashed stochastic rounding) run as one compiled loop nest instead of
~20-40 eager passes over each row block (2-core CPU: 8-bit AdamW state 7.5 -> ~1.7 ns per element, bf16 state
3.4 -> ~1.5).

The loop is :func:`_kernel`, compiled ahead of time by AOTInductor into a shared library, in a child process, once
per variant (rule, dtypes), and cached (``~/.cache/memgrad_hf``, or ``$MEMGRAD_CACHE_DIR``; ~10-30 s per variant on
first use). The training process only loads the library: the compiler's memory (~100+ MiB of tracing and codegen)
never lands in it, and nothing is compiled at step time.

The math is :func:`memgrad_hf.kernels.forge._apply_rows`' (the same rules, codes and noise, element for element),
written with ops the compiler fuses. The compiler may contract a multiply-add into one FMA, so fp32 values can differ
from eager by one fp32 rounding before they are rounded to the storage dtype; the integer parts (noise, code
rounding) are identical. All-fp32 optimizers never come here: they stay on the eager path, bit-exact with
``torch.optim``.

``MEMGRAD_COMPILE=0`` turns the fast path off. If building or loading fails (no C++ compiler, an unsupported
platform), a warning is logged once and the eager path is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from memgrad_hf.kernels import forge as K
from memgrad_hf.kernels import state_codes as S

logger = logging.getLogger(__name__)

_FAILED: list[str] = []  # the first build/load error, if any: then the eager path is used for the process
_RUNNERS: dict[tuple, Any] = {}
calls = 0  # compiled row-block updates run (tests read it)


def enabled(p: Tensor, st: dict[str, Tensor], rule: str) -> bool:
    """Whether :func:`apply_rows` handles this update: CPU tensors, a reduced-precision state or weight, a rule it
    knows, 8-bit rows that are whole quantization blocks, and compiling not disabled or failed."""
    if p.device.type != "cpu" or _FAILED or os.environ.get("MEMGRAD_COMPILE", "1").strip() == "0":
        return False
    if rule not in K.KERNEL_RULES or p.dim() == 0 or p.shape[-1] % K.Q_BLOCK:
        return False
    dtypes = {v.dtype for k, v in st.items() if not k.endswith(".scale")} | {p.dtype}
    if dtypes == {torch.float32} or not dtypes <= {torch.float32, torch.bfloat16, K.Q_DTYPE}:
        return False
    return p.is_contiguous() and all(v.is_contiguous() for v in st.values())


def _noise(like: Tensor, key: Tensor, bits: int) -> Tensor:
    """:func:`memgrad_hf.kernels.forge.hash_bits` for a tensor shaped ``like``, with the key (``noise_key(seed) +
    offset``, int32) as data."""
    rows, cols = like.shape
    x = torch.arange(cols, dtype=torch.int32, device=key.device) + (
        torch.arange(rows, dtype=torch.int32, device=key.device) * cols)[:, None] + key
    x = x ^ ((x >> 16) & 0xFFFF)  # logical shifts on int32: arithmetic shift, then mask
    x = x * K.as_int32(K._H1)  # int32 products wrap mod 2^32, as uint32 ones do
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * K.as_int32(K._H2)
    x = x ^ ((x >> 16) & 0xFFFF)
    return x & ((1 << bits) - 1)


def _round_stochastic(x: Tensor, key: Tensor, drop: int) -> Tensor:
    """Add noise below bit ``drop`` to fp32 bits and clear those bits (the eager ``_sr_truncate`` for drop=16)."""
    bits = x.view(torch.int32) + _noise(x, key, drop)
    return (bits & -(1 << drop)).view(torch.float32)


# Tensors come in as [blocks, Q_BLOCK] views (one row per 8-bit block, scales [blocks]): a static inner size keeps
# the generated index arithmetic simple; only the number of blocks varies between calls.


def _dequantize(codes: Tensor, scale: Tensor, positive: bool) -> Tensor:
    return S.decode(codes, positive) * scale[:, None]


def _quantize(x: Tensor, key: Tensor | None, positive: bool) -> tuple[Tensor, Tensor]:
    """:func:`memgrad_hf.kernels.state_codes.quantize_8bit` on ``[blocks, Q_BLOCK]``."""
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / S.q_max(positive), torch.ones_like(amax))
    y = x / scale[:, None]
    noise = None if key is None else _noise(y, key, S.NOISE_BITS)
    return S.encode(y, noise, positive), scale


def _coefficients(rule: str, hp: dict[str, Any], step: int) -> Tensor:
    """The rule's step scalars, computed in Python doubles exactly as the eager rules compute them, then as fp32
    (eager applies Python scalars to fp32 tensors in fp32). Data, not constants: no recompile per step."""
    lr, wd = hp["lr"], hp["weight_decay"]
    if rule.startswith("sgd"):
        # the buffer's first step and Nesterov as coefficients: buf·0 + d·1 and d·0 + buf·1 are exact
        mom, damp = hp.get("momentum", 0.0), hp.get("dampening", 0.0)
        keep = (0.0, 1.0) if step == 1 else (mom, 1 - damp)
        c = [-lr, wd, *keep, *((1.0, mom) if hp.get("nesterov") else (0.0, 1.0))]
        return torch.tensor(c, dtype=torch.float32)
    b1, b2 = hp["betas"]
    if rule == "adamw":
        c = [1 - lr * wd, 1 - b1, b2, 1 - b2, (1 - b2**step) ** 0.5, hp["eps"], -(lr / (1 - b1**step))]
    else:
        c = [1 - lr * wd, 1 - b1, -lr, 1 - b2]
    return torch.tensor(c, dtype=torch.float32)


def _adamw(p: Tensor, g: Tensor, m: Tensor, v: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`memgrad_hf.kernels.forge.adamw_`, out of place, in its op order."""
    p = p * c[0]
    m = m.lerp(g, c[1])
    v = v * c[2] + g * g * c[3]
    return p + c[6] * (m / (v.sqrt() / c[4] + c[5])), m, v


def _lion(p: Tensor, g: Tensor, m: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`memgrad_hf.kernels.forge.lion_`, out of place."""
    p = p * c[0]
    p = p + c[2] * m.lerp(g, c[1]).sign()
    return p, m.lerp(g, c[3])


def _sgd(p: Tensor, g: Tensor, buf: Tensor | None, c: Tensor) -> tuple[Tensor, Tensor | None]:
    """:func:`memgrad_hf.kernels.forge.sgd_`, out of place (``buf`` None: no momentum)."""
    d = g + c[1] * p
    if buf is not None:
        buf = buf * c[2] + d * c[3]
        d = d * c[4] + buf * c[5]
    return p + c[0] * d, buf


def _load(st: dict[str, Tensor], n: str) -> Tensor:
    if st[n].dtype == K.Q_DTYPE:  # 8-bit keeps sqrt(v)
        y = _dequantize(st[n], st[n + ".scale"], positive=n == "exp_avg_sq")
        return y.square() if n == "exp_avg_sq" else y
    return st[n].float()


def _save(st: dict[str, Tensor], n: str, x: Tensor, key: Tensor) -> None:
    """Round like the eager ``_apply_rows``: second moments stochastically, first moments to nearest."""
    if st[n].dtype == K.Q_DTYPE:
        if n == "exp_avg_sq":
            codes, scale = _quantize(x.sqrt(), key, positive=True)
        else:
            codes, scale = _quantize(x, None, positive=False)
        st[n].copy_(codes)
        st[n + ".scale"].copy_(scale)
    elif st[n].dtype == torch.bfloat16 and n == "exp_avg_sq":
        st[n].copy_(_round_stochastic(x, key, 16))
    else:
        st[n].copy_(x)


def _kernel(rule: str, stochastic_p: bool, p: Tensor, g: Tensor, st: dict[str, Tensor], c: Tensor,
            keys: Tensor) -> None:
    """``keys``: int32 ``noise_key(seed) + offset`` for ``p``, then for each state tensor of the rule."""
    p32, g32 = p.float(), g.float()
    if rule == "adamw":
        p32, m, v = _adamw(p32, g32, _load(st, "exp_avg"), _load(st, "exp_avg_sq"), c)
        _save(st, "exp_avg", m, keys[1])
        _save(st, "exp_avg_sq", v, keys[2])
    elif rule == "lion":
        p32, m = _lion(p32, g32, _load(st, "exp_avg"), c)
        _save(st, "exp_avg", m, keys[1])
    else:
        p32, buf = _sgd(p32, g32, _load(st, "momentum_buffer") if rule == "sgd_momentum" else None, c)
        if buf is not None:
            _save(st, "momentum_buffer", buf, keys[1])
    if p.dtype == torch.float32:
        p.copy_(p32)
    else:
        p.copy_(_round_stochastic(p32, keys[0], 16) if stochastic_p else p32)


_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "q8": K.Q_DTYPE}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _variant(rule: str, p: Tensor, st: dict[str, Tensor], stochastic_p: bool) -> tuple:
    return (rule, _NAMES[p.dtype], tuple(_NAMES[st[n].dtype] for n in K.RULES[rule][1]), bool(stochastic_p))


def _flat_args(rule: str, p: Tensor, g: Tensor, st: dict[str, Tensor], c: Tensor, keys: Tensor) -> list[Tensor]:
    """The library's inputs in order: p, g, then per state tensor its values (and 8-bit scales), c, keys; every
    tensor as ``[blocks, Q_BLOCK]`` rows (scales ``[blocks]``)."""
    out = [p.view(-1, K.Q_BLOCK), g.reshape(-1, K.Q_BLOCK)]
    for n in K.RULES[rule][1]:
        out.append(st[n].view(-1, K.Q_BLOCK))
        if st[n].dtype == K.Q_DTYPE:
            out.append(st[n + ".scale"].view(-1))
    return [*out, c, keys]


class _Module(torch.nn.Module):
    """:func:`_kernel` with flat inputs, for ``torch.export``."""

    def __init__(self, variant: tuple):
        super().__init__()
        self.rule, _, self.states, self.stochastic_p = variant

    def forward(self, *args: Tensor) -> tuple:
        p, g, rest = args[0], args[1], list(args[2:])
        st = {}
        for n, kind in zip(K.RULES[self.rule][1], self.states, strict=True):
            st[n] = rest.pop(0)
            if kind == "q8":
                st[n + ".scale"] = rest.pop(0)
        _kernel(self.rule, self.stochastic_p, p, g, st, rest[0], rest[1])
        return ()


def _example(variant: tuple, blocks: int = 16) -> list[Tensor]:
    rule, p_kind, states, _ = variant
    p = torch.zeros(blocks, K.Q_BLOCK, dtype=_DTYPES[p_kind])
    st = {}
    for n, kind in zip(K.RULES[rule][1], states, strict=True):
        st[n] = torch.zeros(blocks, K.Q_BLOCK, dtype=_DTYPES[kind])
        if kind == "q8":
            st[n + ".scale"] = torch.ones(blocks)
    c = _coefficients(rule, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.9}, 2)
    return _flat_args(rule, p, torch.zeros(blocks, K.Q_BLOCK), st, c, torch.zeros(len(states) + 1, dtype=torch.int32))


def build(variant: tuple, path: str) -> None:
    """Export :func:`_kernel` for ``variant`` with a dynamic block count and compile it with AOTInductor into
    ``path`` (run in a child process by :func:`_runner`)."""
    args = _example(variant)
    blocks = torch.export.Dim("blocks", min=1, max=1 << 40)
    dyn = [{0: blocks} for _ in args[:-2]] + [None, None]  # every tensor but the coefficients and keys
    ep = torch.export.export(_Module(variant), tuple(args), dynamic_shapes=(tuple(dyn),))  # forward(*args)
    torch._inductor.aoti_compile_and_package(ep, package_path=path)


def _cache_path(variant: tuple) -> Path:
    src = b"".join(Path(f).read_bytes() for f in (__file__, K.__file__, S.__file__))
    tag = hashlib.sha256(src + repr((variant, torch.__version__, torch.backends.cpu.get_cpu_capability())).encode())
    root = Path(os.environ.get("MEMGRAD_CACHE_DIR") or Path.home() / ".cache" / "memgrad_hf")
    return root / "forge_aot" / f"{'-'.join(map(str, variant[:2]))}-{tag.hexdigest()[:20]}.pt2"


def _build_cached(variant: tuple, path: Path) -> None:
    """Build ``variant`` into ``path`` in a child process (the compiler's memory never lands in this one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("memgrad_hf: compiling the FORGE CPU update %s once (cached in %s)", variant, path.parent)
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
    os.close(fd)
    try:
        # the child imports this package from where the parent found it, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])])}
        res = subprocess.run([sys.executable, "-m", "memgrad_hf.kernels.forge_compiled", json.dumps(variant), tmp],
                             capture_output=True, text=True, env=env)
        if res.returncode != 0:
            logger.debug("memgrad_hf: the FORGE CPU update's build said:\n%s", res.stderr[-4000:])
            lines = res.stderr.strip().splitlines()  # the last line is the error; the rest, its traceback
            raise RuntimeError(f"building the compiled update failed: {lines[-1] if lines else res.returncode}")
        os.chmod(tmp, 0o644)  # (mkstemp's 0600 would keep a shared cache directory's entries from other users)
        os.replace(tmp, path)  # atomic: concurrent builders each write their own file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _runner(variant: tuple):
    runner = _RUNNERS.get(variant)
    if runner is None:
        path = _cache_path(variant)
        if not path.exists():
            _build_cached(variant, path)
        try:
            runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        except Exception as e:  # a damaged cache entry (a truncated copy, a full disk): built again, once
            logger.warning("memgrad_hf: the cached FORGE CPU update %s could not be loaded (%s); building it again.",
                           path, str(e).strip().splitlines()[-1] if str(e).strip() else repr(e))
            path.unlink(missing_ok=True)
            _build_cached(variant, path)
            runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        _RUNNERS[variant] = runner
    return runner


def apply_rows(rule: str, p: Tensor, g: Tensor, st: dict[str, Tensor], hp: dict[str, Any], step: int,
               stochastic_rounding: bool, seeds: dict[str, int], offset: int) -> bool:
    """Run ``rule`` on a row block like :func:`memgrad_hf.kernels.forge._apply_rows`, in place; ``False`` if the
    compiled update cannot be built or loaded (then nothing was changed and the caller runs the eager path)."""
    global calls
    names = K.RULES[rule][1]
    try:
        runner = _runner(_variant(rule, p, st, stochastic_rounding))
    except Exception as e:  # a compiler or platform problem, before anything is written
        _FAILED.append(repr(e))
        logger.warning("memgrad_hf: the compiled FORGE CPU update is unavailable (%s); using the slower eager path. "
                       "Set MEMGRAD_COMPILE=0 to skip the attempt.", str(e).strip().splitlines()[-1] if str(e).strip()
                       else repr(e))
        return False
    keys = torch.tensor([K.as_int32(K.noise_key(seeds[n]) + offset) for n in ("p", *names)], dtype=torch.int32)
    g = g if g.dtype == torch.float32 else g.float()
    runner.run(_flat_args(rule, p, g, st, _coefficients(rule, hp, step), keys))
    calls += 1
    return True


if __name__ == "__main__":  # python -m memgrad_hf.kernels.forge_compiled VARIANT_JSON OUT_PATH (see _runner)
    v = json.loads(sys.argv[1])
    build((v[0], v[1], tuple(v[2]), bool(v[3])), sys.argv[2])
