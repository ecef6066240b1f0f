"""The compiled CPU loop for reduced-precision FORGE updates against the eager path it replaces."""

import logging

import pytest
import torch

from memgrad_hf.kernels import forge as K
from memgrad_hf.kernels import forge_compiled as C


def _state(rule: str, dtype: torch.dtype, rows: int, cols: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    st = {}
    for n in K.RULES[rule][1]:
        x = torch.randn(rows, cols, generator=g).abs_() * 1e-3
        if dtype == K.Q_DTYPE:
            st[n], st[n + ".scale"] = K.quantize_8bit(x.sqrt() if n == "exp_avg_sq" else x, positive=n == "exp_avg_sq")
        else:
            st[n] = x.to(dtype)
    return st


def test_noise_is_the_eager_hash_bit_for_bit():
    for shape, seed, offset in [((7, 64), 3, 0), ((33, 128), 12345, 987654), ((1, 64), 2**31 + 5, 2**32 - 64)]:
        key = torch.tensor(K.as_int32(K.noise_key(seed) + offset), dtype=torch.int32)
        for bits in (16, 20):
            got = C._noise(torch.empty(shape), key, bits)  # the formula; the compiled use is tested below
            assert torch.equal(got, K.hash_bits(seed, offset, shape, bits, "cpu"))


@pytest.mark.parametrize("rule", ["adamw", "lion", "sgd_momentum"])
@pytest.mark.parametrize("case", ["8bit", "bf16_state", "bf16_weight", "bf16_weight_sr"])
def test_compiled_update_equals_eager_to_an_fp32_rounding(rule, case):
    rows, cols = 40, 192
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(rows, cols, generator=gen)
    g = torch.randn(rows, cols, generator=gen) * 1e-2
    state_dtype = {"8bit": K.Q_DTYPE, "bf16_state": torch.bfloat16}.get(case, torch.float32)
    if case.startswith("bf16_weight"):
        p = p.bfloat16()
    st_e, st_c = _state(rule, state_dtype, rows, cols), _state(rule, state_dtype, rows, cols)
    p_e, p_c = p.clone(), p.clone()
    assert C.enabled(p_c, st_c, rule), C._FAILED
    hp = {"lr": 1e-2, "betas": (0.9, 0.999) if rule == "adamw" else (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1,
          "momentum": 0.9, "dampening": 0.0, "nesterov": case.endswith("sr")}
    sr = case == "bf16_weight_sr"
    seeds = K.rounding_seeds(11, K.RULES[rule][1])
    before = C.calls
    assert C.apply_rows(rule, p_c, g, st_c, hp, 3, sr, seeds, 640), C._FAILED
    assert C.calls == before + 1
    K._apply_rows(K.RULES[rule][0], K.RULES[rule][1], p_e, g, st_e, hp, 3, sr, seeds, 640)
    # weights: fp32 within two roundings; a bf16 weight may land one bf16 spacing apart where the fp32 value sits
    # on a rounding boundary (a contracted multiply-add), which is rare
    if p.dtype == torch.float32:
        torch.testing.assert_close(p_c, p_e, rtol=2.4e-7, atol=1e-9)
    else:
        diff = (p_c.float() - p_e.float()).abs()
        assert (diff <= p_e.float().abs() * 2**-7).all() and (diff > 0).float().mean() < 0.01, diff.max()
    for n, v in st_e.items():
        if v.dtype == torch.float32:  # fp32 state (values ~1e-3; a contracted lerp cancels differently near 0) and
            # 8-bit scales (amax / Q_MAX may become a reciprocal multiply)
            torch.testing.assert_close(st_c[n], v, rtol=2.4e-7, atol=0 if n.endswith(".scale") else 1e-9)
        else:  # codes and bf16 values come from the same noise: equal except at rare rounding boundaries
            assert (st_c[n].float() != v.float()).float().mean() < 0.01, (n, (st_c[n].float() - v.float()).abs().max())


def test_trainer_style_use_goes_through_the_compiled_loop_and_can_be_turned_off(monkeypatch):
    p = torch.randn(16, 128)
    st = _state("adamw", K.Q_DTYPE, 16, 128)
    hp = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    before = C.calls
    K.apply_rule("adamw", p, torch.randn(16, 128), st, hp, 1)
    assert C.calls > before
    monkeypatch.setenv("MEMGRAD_COMPILE", "0")
    before = C.calls
    K.apply_rule("adamw", p, torch.randn(16, 128), st, hp, 2)
    assert C.calls == before
    # fp32 everything stays eager (bit-exact with torch.optim); so do rows that are not whole 8-bit blocks
    monkeypatch.delenv("MEMGRAD_COMPILE")
    assert not C.enabled(p, {"exp_avg": p.clone(), "exp_avg_sq": p.clone()}, "adamw")
    assert not C.enabled(torch.randn(4, 100), {"exp_avg": torch.zeros(4, 100, dtype=torch.bfloat16)}, "lion")


def test_a_failed_compile_falls_back_to_eager_with_a_warning(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(C, "_runner", broken)
    monkeypatch.setattr(C, "_FAILED", [])
    p = torch.randn(8, 64)
    st_f, st_e = _state("lion", torch.bfloat16, 8, 64), _state("lion", torch.bfloat16, 8, 64)
    p_f, p_e = p.clone(), p.clone()
    g = torch.randn(8, 64)
    hp = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.0}
    with caplog.at_level(logging.WARNING):
        K.apply_rule("lion", p_f, g, st_f, hp, 1)
    assert "compiled FORGE CPU update is unavailable" in caplog.text and "MEMGRAD_COMPILE=0" in caplog.text
    assert not C.enabled(p_f, st_f, "lion")  # not retried
    monkeypatch.setenv("MEMGRAD_COMPILE", "0")
    K.apply_rule("lion", p_e, g, st_e, hp, 1)
    assert torch.equal(p_f, p_e) and torch.equal(st_f["exp_avg"], st_e["exp_avg"])


def test_a_damaged_cache_entry_is_built_again_and_a_failed_build_names_its_error(monkeypatch, tmp_path, caplog):
    # a corrupt .pt2 warned in every process (without its path) and was never rebuilt; a failed build's warning
    # showed a random line of the traceback's tail instead of the error
    import types

    monkeypatch.setenv("MEMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(C, "_RUNNERS", {})
    variant = ("lion", "x", (), False)
    path = C._cache_path(variant)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a zip archive")
    loads, builds = [], []

    def loader(p, *args):
        loads.append(open(p, "rb").read())
        if loads[-1] != b"good":
            raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
        return "runner"

    def build(v, p):
        builds.append(v)
        p.write_bytes(b"good")

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", loader)
    monkeypatch.setattr(C, "_build_cached", build)
    with caplog.at_level(logging.WARNING):
        assert C._runner(variant) == "runner"
    assert builds == [variant] and loads == [b"not a zip archive", b"good"]
    assert str(path) in caplog.text and "building it again" in caplog.text

    monkeypatch.undo()
    err = "Traceback (most recent call last):\n  File \"x.py\", line 1\nInductorError: InvalidCxxCompiler: no compiler"
    monkeypatch.setattr(C.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=1, stderr=err))
    monkeypatch.setenv("MEMGRAD_CACHE_DIR", str(tmp_path / "other"))
    with pytest.raises(RuntimeError, match="failed: InductorError: InvalidCxxCompiler: no compiler$"):
        C._build_cached(variant, C._cache_path(variant))
    assert not list((tmp_path / "other").rglob("*.pt2"))  # no half-written entry left
