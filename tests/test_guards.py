"""The exact kernels' guards on the CPU: each signature function decides where its Triton kernel may run (else the
eager twin runs). With the device check pretended true, every refusal of the table is tried on CPU tensors, and the
accepted layouts give distinct signatures; a guard that let an unsupported layout through would hand the kernel
memory it cannot read (GPU: wrong values, not an error). The kernels themselves: tests/test_flux_lossless.py."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import kernels.rope as rope

B, I, T, H, D = 2, 5, 4, 3, 8


@pytest.fixture
def as_cuda(monkeypatch) -> None:
    monkeypatch.setattr(rope, "_device_supported", lambda device: True)


def _rope_args(**over: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    args = dict(txt=torch.randn(B, T, H, D, generator=g), img=torch.randn(B, I, H, D, generator=g),
                cos=torch.randn(T + I, D, generator=g), sin=torch.randn(T + I, D, generator=g))
    args.update(over)
    return args


def _strided_rows() -> torch.Tensor:  # rows of H * D with a gap between tokens: stride(2) is D, stride(1) is not
    return torch.randn(B, I, H * D + 8)[..., : H * D].unflatten(-1, (H, D))


ROPE_REFUSALS: list[tuple[str, Callable[[], dict[str, Any]]]] = [
    ("3-D image", lambda: _rope_args(img=torch.randn(B, I, H * D))),
    ("float64", lambda: _rope_args(txt=torch.randn(B, T, H, D, dtype=torch.float64),
                                   img=torch.randn(B, I, H, D, dtype=torch.float64))),
    ("int image", lambda: _rope_args(img=torch.zeros(B, I, H, D, dtype=torch.int32))),
    ("text of another dtype", lambda: _rope_args(txt=torch.randn(B, T, H, D, dtype=torch.float16))),
    ("text of another batch", lambda: _rope_args(txt=torch.randn(B + 1, T, H, D))),
    ("text of other heads", lambda: _rope_args(txt=torch.randn(B, T, H + 1, D))),
    ("text of another head size", lambda: _rope_args(txt=torch.randn(B, T, H, D + 2))),
    ("head size not unit-strided", lambda: _rope_args(img=torch.randn(B, I, D, H).transpose(2, 3))),
    ("heads not one row", lambda: _rope_args(img=torch.randn(B, I, H, 2 * D)[..., :D])),
    ("text heads not one row", lambda: _rope_args(txt=torch.randn(B, T, H, 2 * D)[..., :D])),
    ("cos in bf16", lambda: _rope_args(cos=torch.randn(T + I, D, dtype=torch.bfloat16))),
    ("sin in bf16", lambda: _rope_args(sin=torch.randn(T + I, D, dtype=torch.bfloat16))),
    ("cos of another length", lambda: _rope_args(cos=torch.randn(T + I + 1, D))),
    ("sin of another width", lambda: _rope_args(sin=torch.randn(T + I, D + 2))),
    ("cos not contiguous", lambda: _rope_args(cos=torch.randn(D, T + I).t())),
    ("odd head size", lambda: _rope_args(txt=torch.randn(B, T, H, 7), img=torch.randn(B, I, H, 7),
                                         cos=torch.randn(T + I, 7), sin=torch.randn(T + I, 7))),
    ("empty batch", lambda: _rope_args(txt=torch.randn(0, T, H, D), img=torch.randn(0, I, H, D))),
]


@pytest.mark.parametrize("case", ROPE_REFUSALS, ids=[c[0] for c in ROPE_REFUSALS])
def test_rope_guard_refuses(as_cuda, case) -> None:
    assert rope._signature(**case[1]()) is None


def test_rope_guard_accepts_and_tells_layouts_apart(as_cuda, monkeypatch) -> None:
    joint = rope._signature(**_rope_args())
    assert joint is not None and joint[-1] is False
    alone = _rope_args(txt=None, cos=torch.randn(I, D), sin=torch.randn(I, D))
    assert rope._signature(**alone)[-1] is True and rope._signature(**alone) != joint
    strided = _rope_args(img=_strided_rows())  # token rows with a gap are fine: the kernel takes stride(1)
    assert rope._signature(**strided) not in (None, joint)
    for dtype in (torch.float16, torch.bfloat16):
        args = _rope_args(txt=torch.randn(B, T, H, D, dtype=dtype), img=torch.randn(B, I, H, D, dtype=dtype))
        assert rope._signature(**args) is not None
    grad = _rope_args(img=torch.randn(B, I, H, D, requires_grad=True))
    assert rope._signature(**grad) is None  # autograd: eager keeps the graph
    with torch.no_grad():
        assert rope._signature(**grad) is not None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert rope._signature(**_rope_args()) is None  # inside a trace the twin is traced


def test_rope_guard_is_off_the_cpu() -> None:
    assert rope._signature(**_rope_args()) is None and not rope._device_supported(torch.device("cpu"))


def _norms(d: int = D, **kw: Any) -> tuple[nn.RMSNorm, nn.RMSNorm]:
    return nn.RMSNorm(d, eps=1e-6, **kw), nn.RMSNorm(d, eps=1e-5, **kw)


RMS_REFUSALS: list[tuple[str, Callable[[], tuple]]] = [
    ("head size not a power of two", lambda: (_rope_args(txt=torch.randn(B, T, H, 12), img=torch.randn(B, I, H, 12),
                                                         cos=torch.randn(T + I, 12), sin=torch.randn(T + I, 12)),
                                              _norms(12))),
    ("head size below 8", lambda: (_rope_args(txt=torch.randn(B, T, H, 4), img=torch.randn(B, I, H, 4),
                                              cos=torch.randn(T + I, 4), sin=torch.randn(T + I, 4)), _norms(4))),
    ("head size above 128", lambda: (_rope_args(txt=torch.randn(1, 1, 1, 256), img=torch.randn(1, 1, 1, 256),
                                                cos=torch.randn(2, 256), sin=torch.randn(2, 256)), _norms(256))),
    ("not an RMSNorm", lambda: (_rope_args(), (nn.LayerNorm(D), _norms()[1]))),
    ("no weight", lambda: (_rope_args(), _norms(elementwise_affine=False))),
    ("no eps", lambda: (_rope_args(), (nn.RMSNorm(D), _norms()[1]))),
    ("norm of another width", lambda: (_rope_args(), (nn.RMSNorm(2 * D, eps=1e-6), _norms()[1]))),
    ("weight of another dtype", lambda: (_rope_args(), (nn.RMSNorm(D, eps=1e-6, dtype=torch.float16), _norms()[1]))),
    ("weight not contiguous", lambda: (_rope_args(), (_strided_weight(), _norms()[1]))),
    ("image rows misaligned", lambda: (_rope_args(img=torch.randn(B * I * H * D + 1)[1:].view(B, I, H, D)), _norms())),
    ("text rows misaligned", lambda: (_rope_args(txt=torch.randn(B * T * H * D + 1)[1:].view(B, T, H, D)), _norms())),
    ("outer guard refuses", lambda: (_rope_args(cos=torch.randn(1, D)), _norms())),
]


def _strided_weight() -> nn.RMSNorm:
    norm = nn.RMSNorm(D, eps=1e-6)
    norm.weight = nn.Parameter(torch.randn(2 * D)[::2])
    return norm


@pytest.mark.parametrize("case", RMS_REFUSALS, ids=[c[0] for c in RMS_REFUSALS])
def test_rms_rope_guard_refuses(as_cuda, case) -> None:
    args, (norm_txt, norm_img) = case[1]()
    with torch.no_grad():
        assert rope._rms_signature(args["txt"], args["img"], norm_txt, norm_img, args["cos"], args["sin"]) is None


def test_rms_rope_guard_accepts_and_keys_on_eps_and_weights(as_cuda) -> None:
    args = _rope_args()
    norm_txt, norm_img = _norms()
    with torch.no_grad():
        sig = rope._rms_signature(args["txt"], args["img"], norm_txt, norm_img, args["cos"], args["sin"])
        assert sig is not None and (1e-6, 1e-5) in sig
        alone = rope._rms_signature(None, args["img"][:, :, :, :], None, norm_img, args["cos"][:I], args["sin"][:I])
        assert alone is not None and (1e-5,) in alone
        other_eps = rope._rms_signature(args["txt"], args["img"], nn.RMSNorm(D, eps=1e-4), norm_img, args["cos"],
                                        args["sin"])
        assert other_eps is not None and other_eps != sig
    # a trainable weight under autograd keeps the eager graph
    assert rope._rms_signature(args["txt"], args["img"], norm_txt, norm_img, args["cos"], args["sin"]) is None
    with torch.no_grad():
        assert rope.rms_rope_fast(args["txt"], args["img"], norm_txt, norm_img, args["cos"][:1], args["sin"]) is None


# -- kernels/modulate.py --------------------------------------------------------------------------------------------

import kernels.modulate as modulate  # noqa: E402

S, W = 6, 16


@pytest.fixture
def modulate_as_cuda(monkeypatch) -> None:
    monkeypatch.setattr(modulate, "_device_supported", lambda device: True)


def _mod_args(**over: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    args = dict(normed=torch.randn(B, S, W, generator=g), scale=torch.randn(B, W, generator=g),
                shift=torch.randn(B, W, generator=g))
    args.update(over)
    return args


MOD_REFUSALS: list[tuple[str, Callable[[], dict[str, Any]]]] = [
    ("2-D input", lambda: _mod_args(normed=torch.randn(B * S, W))),
    ("float64", lambda: _mod_args(normed=torch.randn(B, S, W, dtype=torch.float64))),
    ("columns not unit-strided", lambda: _mod_args(normed=torch.randn(B, W, S).transpose(1, 2))),
    ("empty", lambda: _mod_args(normed=torch.randn(B, 0, W))),
    ("scale of another shape", lambda: _mod_args(scale=torch.randn(B, W + 1))),
    ("shift of another batch", lambda: _mod_args(shift=torch.randn(B + 1, W))),
    ("scale of another dtype", lambda: _mod_args(scale=torch.randn(B, W, dtype=torch.float16))),
    ("shift not unit-strided", lambda: _mod_args(shift=torch.randn(W, B).t())),
]


@pytest.mark.parametrize("case", MOD_REFUSALS, ids=[c[0] for c in MOD_REFUSALS])
def test_modulate_guard_refuses(modulate_as_cuda, case) -> None:
    assert modulate._signature(**case[1]()) is None


def test_modulate_guard_accepts(modulate_as_cuda, monkeypatch) -> None:
    sig = modulate._signature(**_mod_args())
    assert sig is not None and sig != modulate._signature(**_mod_args(normed=torch.randn(B, S + 1, W)))
    rows = torch.randn(B, S, 2 * W)[..., :W]  # rows with a gap: fine for modulate, not for the LayerNorm pass
    assert modulate._signature(**_mod_args(normed=rows)) is not None
    assert modulate._ln_signature(rows, torch.randn(B, W), torch.randn(B, W), 1e-6) is None
    ln = modulate._ln_signature(torch.randn(B, S, W), torch.randn(B, W), torch.randn(B, W), 1e-6)
    assert ln is not None and ln[1] == 1e-6
    assert modulate._ln_signature(torch.randn(B, S, 12 + 2), torch.randn(B, 14), torch.randn(B, 14), 1e-6) is None
    misaligned = torch.randn(B * S * W + 1)[1:].view(B, S, W)
    assert modulate._ln_signature(misaligned, torch.randn(B, W), torch.randn(B, W), 1e-6) is None
    grad = _mod_args(scale=torch.randn(B, W, requires_grad=True))
    assert modulate._signature(**grad) is None
    with torch.no_grad():
        assert modulate._signature(**grad) is not None
    # the fast kernel: half precision only, and rows up to 16384 wide
    half = {k: v.half() for k, v in _mod_args().items()}
    assert modulate._fast_supported(half["normed"], half["scale"], half["shift"])
    assert not modulate._fast_supported(*_mod_args().values())
    wide = torch.randn(1, 1, 16384 + 16, dtype=torch.float16)
    assert not modulate._fast_supported(wide, torch.randn(1, 16400, dtype=torch.float16),
                                        torch.randn(1, 16400, dtype=torch.float16))
    edge = torch.randn(1, 1, 16384, dtype=torch.float16)
    assert modulate._fast_supported(edge, torch.randn(1, 16384, dtype=torch.float16),
                                    torch.randn(1, 16384, dtype=torch.float16))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert modulate._signature(**_mod_args()) is None


# -- kernels/gelu.py: the GELU written into a column slice ----------------------------------------------------------

import kernels.gelu as gelu  # noqa: E402


def _slice(rows: tuple[int, ...], n: int, width: int) -> torch.Tensor:
    return torch.empty(*rows, width)[..., width - n:]  # the last n columns of a contiguous buffer


GELU_REFUSALS: list[tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = [
    ("float64", lambda: (torch.randn(4, 8, dtype=torch.float64), torch.empty(4, 8, dtype=torch.float64))),
    ("1-D", lambda: (torch.randn(8), torch.empty(8))),
    ("shape differs", lambda: (torch.randn(4, 8), torch.empty(4, 9))),
    ("dtype differs", lambda: (torch.randn(4, 8), torch.empty(4, 8, dtype=torch.float16))),
    ("input not contiguous", lambda: (torch.randn(8, 4).t(), torch.empty(4, 8))),
    ("out columns not unit-strided", lambda: (torch.randn(4, 8), torch.empty(8, 4).t())),
    ("out rows unevenly strided", lambda: (torch.randn(2, 3, 8), torch.empty(2, 4, 8)[:, :3])),
]


@pytest.mark.parametrize("case", GELU_REFUSALS, ids=[c[0] for c in GELU_REFUSALS])
def test_gelu_into_guard_refuses(monkeypatch, case) -> None:
    monkeypatch.setattr(gelu, "_into_device_supported", lambda device: True)
    assert gelu._gelu_into_signature(*case[1]()) is None


def test_gelu_into_guard_accepts_column_slices(monkeypatch) -> None:
    monkeypatch.setattr(gelu, "_into_device_supported", lambda device: True)
    for rows in ((4,), (2, 3)):
        h = torch.randn(*rows, 8)
        assert gelu._gelu_into_signature(h, _slice(rows, 8, 24)) is not None  # a slice of a wider buffer
        assert gelu._gelu_into_signature(h, torch.empty(*rows, 8)) is not None
    h = torch.randn(4, 8, requires_grad=True)
    assert gelu._gelu_into_signature(h, torch.empty(4, 8)) is None
    with torch.no_grad():
        assert gelu._gelu_into_signature(h, torch.empty(4, 8)) is not None
    monkeypatch.setattr(gelu, "_into_device_supported", lambda device: False)
    assert gelu._gelu_into_signature(torch.randn(4, 8), torch.empty(4, 8)) is None
    assert not gelu._device_supported(torch.device("cpu"))


@pytest.mark.parametrize("empty", ["heads", "head size", "tokens"])
def test_rope_guard_refuses_empty_tensors_of_every_kind(as_cuda, empty: str) -> None:
    """Any empty dimension is refused (and never divides by zero on the way)."""
    h, d, i, t = (0 if empty == "heads" else H), (0 if empty == "head size" else D), (0 if empty == "tokens" else I), (
        0 if empty == "tokens" else T)
    args = _rope_args(txt=torch.randn(B, t, h, d), img=torch.randn(B, i, h, d), cos=torch.randn(t + i, d),
                      sin=torch.randn(t + i, d))
    assert rope._signature(**args) is None


def test_rms_rope_guard_takes_head_size_128_and_refuses_a_norm_without_weight(as_cuda) -> None:
    args = _rope_args(txt=torch.randn(1, 1, 1, 128), img=torch.randn(1, 1, 1, 128), cos=torch.randn(2, 128),
                      sin=torch.randn(2, 128))
    with torch.no_grad():
        assert rope._rms_signature(args["txt"], args["img"], *_norms(128), args["cos"], args["sin"]) is not None
        plain = _rope_args()
        assert rope._rms_signature(plain["txt"], plain["img"], nn.Identity(), _norms()[1], plain["cos"],
                                   plain["sin"]) is None


def test_modulate_signature_keys_on_the_scale_and_shift_layouts(modulate_as_cuda) -> None:
    """FLUX's scale and shift are chunks of one [B, 6D] embedding (row stride 6D): a verdict for that layout must not
    stand for contiguous ones, so both enter the signature."""
    normed = torch.randn(B, S, W)
    emb = torch.randn(B, 6 * W)
    chunked = modulate._signature(normed, emb[:, :W], emb[:, W:2 * W])
    for scale, shift in ((torch.randn(B, W), emb[:, W:2 * W]), (emb[:, :W], torch.randn(B, W))):
        assert modulate._signature(normed, scale, shift) not in (None, chunked)


def test_layer_norm_modulate_eager_keeps_its_eps_and_the_switched_off_path_is_the_twin() -> None:
    import kernels.switches as switches

    x = torch.randn(B, S, W) * 1e-3  # a variance near eps: the eps shows in the result
    scale, shift = torch.randn(B, W), torch.randn(B, W)
    want = modulate.modulate_eager(torch.nn.functional.layer_norm(x, (W,), eps=1e-6), scale, shift)
    assert torch.equal(modulate.layer_norm_modulate_eager(x, scale, shift, 1e-6), want)
    assert not torch.equal(modulate.layer_norm_modulate_eager(x, scale, shift, 1e-5), want)
    with switches.override(layer_norm_modulate=False):
        assert torch.equal(modulate.layer_norm_modulate(x, scale, shift, 1e-6), want)


def test_norm_site_switches_and_their_refusal(modulate_as_cuda) -> None:
    site, plain = nn.Linear(2, 2), nn.Linear(2, 2)
    modulate.mark_norm_site(site)
    root = nn.Sequential(site, plain)
    assert modulate.set_fast_norm(root, True) == 1 and modulate.fast_norm(site) is True
    assert modulate.fast_norm_sites(root) == 1 and modulate.set_fast_norm(root, False) == 0
    assert modulate.fast_norm(site) is False
    with pytest.raises(ValueError) as exc:
        modulate.set_norm_fp8(plain, True)
    assert str(exc.value) == "Linear is not a marked norm site"
    wide = torch.randn(1, 1, 16385, dtype=torch.float16)  # one past the fast kernel's widest row
    assert not modulate._fast_supported(wide, torch.randn(1, 16385, dtype=torch.float16),
                                        torch.randn(1, 16385, dtype=torch.float16))


def test_gelu_site_checks_name_what_stops_a_layer(monkeypatch) -> None:
    """`can_fuse_linear_gelu` and the site check: whole reasons for a foreign layer type, a weight that is not 2-D,
    an input on another device, a site whose attribute is missing or not a module; a site once merged away is gone."""
    monkeypatch.setattr(gelu, "_device_supported", lambda device: device.type == "cpu")

    class Foreign(nn.Module):
        pass

    assert gelu.can_fuse_linear_gelu(Foreign()) == (False, f"unsupported layer type {__name__}.test_gelu_site_checks_"
                                                           "name_what_stops_a_layer.<locals>.Foreign")
    layer = nn.Linear(8, 12).to(torch.bfloat16)
    assert gelu.can_fuse_linear_gelu(layer) == (True, "ok")
    layer.weight = nn.Parameter(torch.randn(12, 8, 1, dtype=torch.bfloat16))
    assert gelu.can_fuse_linear_gelu(layer) == (False, "layer has no 2-D weight")
    layer = nn.Linear(8, 12).to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16, device="meta")
    assert gelu.can_fuse_linear_gelu(layer, x) == (False, "input on meta (weight on cpu)")
    site = nn.Module()
    assert gelu.site_check(site, "gelu_sites:proj") == (False, "attribute 'proj' is not a module")
    site.proj = torch.zeros(1)
    assert gelu.site_check(site, "gelu_sites:proj") == (False, "attribute 'proj' is not a module")
    site = nn.Module()
    site.proj = layer
    gelu.mark_fused_gelu_site(site, "proj")
    assert gelu.site_names(site) == ["proj"] and gelu.site_check(site, "gelu_sites:proj") == (True, "ok")
    gelu.unmark_fused_gelu_site(site, "proj")
    assert gelu.site_names(site) == []


def test_gelu_into_guard_checks_every_leading_stride(monkeypatch) -> None:
    monkeypatch.setattr(gelu, "_into_device_supported", lambda device: True)
    h = torch.randn(2, 3, 5, 8)
    assert gelu._gelu_into_signature(h, torch.empty(2, 3, 5, 8)) is not None  # distinct leading sizes, contiguous
    assert gelu._gelu_into_signature(h, torch.empty(2, 3, 5, 24)[..., :8]) is not None
