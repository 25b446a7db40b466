"""LoRA adapters: loaded once per pipeline through diffusers' loader, picked per request by name and scale.

Lossless with adapters is byte-identical to stock diffusers `FluxPipeline` with the same files loaded by
`load_lora_weights` and the same `set_adapters` scales; adapter sets switch between requests without a reload and
never share a batch; the HTTP schema refuses unknown names and bad scales; the config refuses what is not supported
(tp > 1, compile, converted high layers).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from deployments.config import AppArgs  # noqa: E402
from deployments.errors import BadRequest  # noqa: E402
from model.loading import diffusers_reference, load_pipeline  # noqa: E402
from model.pipeline import GenerationRequest, run_flux_pipeline  # noqa: E402
from model.request import validate_batch  # noqa: E402
from tests._inputs import write_random_kohya_lora, write_random_lora  # noqa: E402

@pytest.fixture(scope="module")
def lora_files(tiny_path: Path, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("loras")
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    return {"ink": str(write_random_lora(pipe.transformer, d / "ink.safetensors", 1)),
            "sun": str(write_random_lora(pipe.transformer, d / "sun.safetensors", 2))}


def _req(loras: tuple = (), quality: str = "lossless", seed: int = 5) -> GenerationRequest:
    return GenerationRequest("a red fox", height=64, width=64, steps=2, seed=seed, quality=quality, loras=loras)


def test_lossless_with_adapters_is_byte_identical_to_stock_diffusers_and_switches_without_reload(
        tiny_path: Path, lora_files: dict[str, str]) -> None:
    ours = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    ref = diffusers_reference(ours)  # diffusers' own load of the folder
    ours.load_loras(lora_files)
    for name, path in lora_files.items():
        ref.load_lora_weights(path, adapter_name=name)

    def stock(loras: tuple) -> tuple[torch.Tensor, bytes]:
        if loras:
            ref.enable_lora()
            ref.set_adapters([n for n, _ in loras], [s for _, s in loras])
        else:
            ref.disable_lora()
        lat, png = run_flux_pipeline(ref, [_req(loras)])
        return lat[0], png[0]

    seen = {}
    for loras in [(("ink", 0.8),), (), (("ink", 0.5),), (("ink", 0.8), ("sun", 0.3)), (("ink", 0.8),)]:
        got = ours.generate([_req(loras)])[0]
        lat, png = stock(loras)
        assert torch.equal(got.latents, lat), loras
        assert got.png == png, loras
        seen[loras] = got.latents
    assert not torch.equal(seen[(("ink", 0.8),)], seen[()])  # the adapter changes the image
    assert not torch.equal(seen[(("ink", 0.8),)], seen[(("ink", 0.5),)])  # and its scale does
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        ours.generate([_req((("nope", 1.0),))])


def test_a_kohya_format_adapter_is_byte_identical_to_stock_diffusers(tiny_path: Path, tmp_path: Path) -> None:
    """sd-scripts keys (fused qkv split by diffusers' converter, alpha scaling) through the same loader."""
    ours = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    ref = diffusers_reference(ours)
    cfg = ours.transformer.config
    path = str(write_random_kohya_lora(tmp_path / "kohya.safetensors", 3, cfg.num_attention_heads *
                                       cfg.attention_head_dim, cfg.num_layers))
    ours.load_loras({"k": path})
    ref.load_lora_weights(path, adapter_name="k")
    ref.set_adapters(["k"], [0.9])
    got = ours.generate([_req((("k", 0.9),))])[0]
    lat, png = run_flux_pipeline(ref, [_req((("k", 0.9),))])
    assert torch.equal(got.latents, lat[0]) and got.png == png[0]
    assert not torch.equal(got.latents, ours.generate([_req()])[0].latents)


def test_high_with_an_adapter_runs_unfused_and_stays_close(tiny_path: Path, lora_files: dict[str, str]) -> None:
    pipe = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    pipe.load_loras({"ink": lora_files["ink"]})
    lossless = pipe.generate([_req((("ink", 0.8),))])[0]
    high = pipe.generate([_req((("ink", 0.8),), quality="high")])[0]
    assert high.ran.gelu_sites == 0  # PEFT layers are not plain linears: the GELU sites refuse, all of them
    assert high.ran.adapters == lossless.ran.adapters == (("ink", 0.8),)
    assert pipe.generate([_req(quality="high")])[0].ran.adapters == ()
    assert torch.allclose(high.latents, lossless.latents, atol=1e-3)
    with pytest.raises(ValueError, match="before converting"):
        conv = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
        conv.convert_for_high(fused_projections=True)
        conv.load_loras({"ink": lora_files["ink"]})


def test_adapter_sets_never_share_a_batch() -> None:
    a, b = _req((("ink", 0.8),)), _req((("ink", 0.5),), seed=6)
    assert a.batch_key() != b.batch_key() != _req().batch_key()
    with pytest.raises(ValueError, match="share loras"):
        validate_batch([a, b])
    with pytest.raises(ValueError, match="once per request"):
        validate_batch([_req((("ink", 0.8), ("ink", 0.2)))])


# ---------------------------------------------------------------------------------------------------------------
# HTTP schema and config
# ---------------------------------------------------------------------------------------------------------------


def _validate(body: dict, loras: dict | None = None, **raw):
    pytest.importorskip("pydantic")
    from deployments.schema import ImageRequest, validate

    args = AppArgs.parse({"loras": loras if loras is not None else {"ink": "/x/ink.safetensors",
                                                                      "sun": "/x/sun.safetensors"}, **raw})
    return validate(ImageRequest(**{"prompt": "a fox", **body}), args, args.model)


def test_request_adapters_become_a_sorted_set_of_every_job() -> None:
    v = _validate({"n": 2, "lora": [{"name": "sun", "scale": 0.3}, {"name": "ink"}]})
    assert [j.loras for j in v.jobs] == [(("ink", 1.0), ("sun", 0.3))] * 2
    assert _validate({}).jobs[0].loras == ()


@pytest.mark.parametrize("lora, message", [
    ([{"name": "nope"}], "unknown LoRA adapter 'nope'; this server serves \\['ink', 'sun'\\]"),
    ([{"name": "ink"}, {"name": "ink", "scale": 0.5}], "named twice"),
    ([{"name": "ink", "scale": 9}], "within"),
    ([{"name": "ink", "scale": float("nan")}], "finite"),
    ([{"name": n} for n in ("ink", "sun", "a", "b", "c")], "at most 4"),
])
def test_bad_adapter_requests_are_400s_with_reasons(lora: list, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        _validate({"lora": lora}, {"ink": "/x/i", "sun": "/x/s", "a": "/x/a", "b": "/x/b", "c": "/x/c"}
                  if len(lora) == 5 else None)
    assert info.value.param == "lora"


def test_a_server_without_adapters_says_so() -> None:
    with pytest.raises(BadRequest, match="serves none"):
        _validate({"lora": [{"name": "ink"}]}, {})


@pytest.mark.parametrize("raw, message", [
    ({"loras": ["ink.safetensors"]}, "map adapter names"),
    ({"loras": {"bad name": "/x"}}, "letters, digits"),
    ({"loras": {"ink": ""}}, "file path"),
    ({"loras": {"ink": "/x"}, "pools": {"high": {"compile": True}}}, "compile"),
    ({"loras": {"ink": "/x"}, "pools": {"high": {"fp8": True}}}, r"fp8 and loras exclude each other: .*fuse_lora"),
])
def test_bad_lora_configs_are_errors(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AppArgs.parse(raw)


@pytest.mark.parametrize("tp", [1, 2])
def test_serving_adapters_keeps_the_high_pool_unconverted_by_default(tp: int) -> None:
    high = AppArgs.parse({"loras": {"ink": "/x"}, "pools": {"high": {"tp": tp}}}).pools["high"]
    assert not high.fp8 and not high.fused_projections and high.tp == tp
    assert AppArgs.parse(None).pools["high"].fp8  # without adapters: converted
    graphed = AppArgs.parse({"loras": {"ink": "/x"}, "device": "cuda", "pools": {"lossless": {"cuda_graphs": True}}})
    assert {"lora", "cuda_graphs"} <= graphed.form("lossless").techniques()  # captured per adapter set


def test_a_fused_adapter_is_byte_identical_to_stock_diffusers_fused(tiny_path: Path, tmp_path: Path) -> None:
    """fuse_lora (a deployment serving one adapter): the adapter, CLIP part included, merged into the weights by
    diffusers' fuse_lora, its layers unloaded; lossless equals stock diffusers fusing both parts, draws what the
    unfused adapter draws (the prompt, encoded before fusing, is encoded again), and the high-tier conversion may
    follow."""
    ours = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    ref = diffusers_reference(ours)
    path = str(write_random_lora(ours.transformer, tmp_path / "ink.safetensors", 1,
                                 text_encoder=ours.pipe.text_encoder))
    lora_files = {"ink": path}
    clip = {n: p.clone() for n, p in ours.pipe.text_encoder.named_parameters()}
    base = ours.generate([_req()])[0]
    ours.load_loras({"ink": lora_files["ink"]})
    unfused = ours.generate([_req((("ink", 1.0),))])[0]
    ours.fuse_lora("ink")
    assert ours.loras == {} and ours.fused_lora == ("ink", 1.0)
    assert not any("lora" in n for n, _ in ours.transformer.named_parameters())  # no adapter layers remain
    ref.load_lora_weights(lora_files["ink"], adapter_name="ink")
    ref.fuse_lora(components=["transformer", "text_encoder"], lora_scale=1.0, adapter_names=["ink"])
    ref.unload_lora_weights()
    assert not any("lora" in n for n, _ in ours.pipe.text_encoder.named_parameters())
    q = next(n for n in clip if n.endswith("layers.0.self_attn.q_proj.weight"))
    assert not torch.equal(ours.pipe.text_encoder.state_dict()[q], clip[q])  # its CLIP part fused
    got = ours.generate([_req()])[0]
    lat, png = run_flux_pipeline(ref, [_req()])
    assert torch.equal(got.latents, lat[0]) and got.png == png[0]
    assert not torch.equal(got.latents, base.latents)
    assert (got.latents - unfused.latents).abs().max() < 1e-3  # merged weights: the same adapter, rounded once
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        ours.fuse_lora("ink")
    ours.convert_for_high(fused_projections=True)
    assert ours.generate([_req(quality="high")])[0].png


def test_fuse_lora_config_and_requests() -> None:
    # fused: plain weights again, so CUDA graphs are allowed
    AppArgs.parse({"loras": {"ink": "/x"}, "fuse_lora": True, "device": "cuda",
                   "pools": {"lossless": {"cuda_graphs": True}}})
    args = AppArgs.parse({"loras": {"ink": "/x"}, "fuse_lora": True})
    assert args.pools["high"].fused_projections and args.pools["high"].fp8  # converted as without adapters
    with pytest.raises(BadRequest, match="'ink' is fused into this deployment's weights"):
        _validate({"lora": [{"name": "ink"}]}, {"ink": "/x"}, fuse_lora=True)
    assert _validate({}, {"ink": "/x"}, fuse_lora=True).jobs[0].loras == ()
    for raw in ({"loras": {"ink": "/x", "sun": "/y"}, "fuse_lora": True}, {"fuse_lora": True}):
        with pytest.raises(ValueError, match="exactly one adapter"):
            AppArgs.parse(raw)


_ENGINE_SCRIPT = """
import sys
from deployments.config import AppArgs
from deployments.engine import LocalEngine
args = AppArgs.parse({"model": sys.argv[1], "loras": {"ink": sys.argv[2]}})
for pool in ("lossless", "high"):
    engine = LocalEngine(args, pool)
    assert engine.pipe.loras == {"ink": sys.argv[2]}, engine.pipe.loras
    assert {"fp8", "fused_projections"}.isdisjoint(engine.stats()["form"]["techniques"])
fused = LocalEngine(AppArgs.parse({"model": sys.argv[1], "loras": {"ink": sys.argv[2]}, "fuse_lora": True}), "high")
assert fused.pipe.fused_lora == ("ink", 1.0) and fused.pipe.loras == {}
assert "fused_projections" in fused.stats()["form"]["techniques"]  # fp8 is refused on the CPU
print("engine loras ok")
"""


def test_each_replica_loads_the_configured_adapters_at_start(tiny_path: Path, lora_files: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(tiny_path), lora_files["ink"]],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0 and "engine loras ok" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


def test_an_edit_with_an_adapter_is_byte_identical_to_stock_diffusers(tiny_path: Path,
                                                                      lora_files: dict[str, str]) -> None:
    """Adapters apply to edits (the edit pipelines share the transformer); the form field is a JSON list."""
    from deployments.schema import validate_edit
    from tests._inputs import random_png

    ours = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    ref = diffusers_reference(ours)
    ours.load_loras({"ink": lora_files["ink"]})
    ref.load_lora_weights(lora_files["ink"], adapter_name="ink")
    ref.set_adapters(["ink"], [0.7])
    image = random_png(1)
    args = AppArgs.parse({"loras": {"ink": lora_files["ink"]}})
    [job] = validate_edit({"prompt": "a red fox", "lora": '[{"name": "ink", "scale": 0.7}]', "steps": "2",
                           "seed": "5"}, {"image": image}, args, "tiny").jobs
    assert job.loras == (("ink", 0.7),) and job.image == image
    got = ours.generate([job])[0]
    lat, png = run_flux_pipeline(ref, [job])
    assert torch.equal(got.latents, lat[0]) and got.png == png[0]
    with pytest.raises(BadRequest, match="lora must be a JSON list"):
        validate_edit({"prompt": "a", "lora": "ink"}, {"image": image}, args, "tiny")


def test_fusing_one_of_two_loaded_adapters_at_a_scale(tiny_path: Path, lora_files: dict[str, str]) -> None:
    """fuse_lora(name, scale) merges that adapter only, at that scale: against stock diffusers fusing the one adapter
    with `lora_scale` (the same merge, rounded in another order: close, not bitwise), far from the adapter at full
    scale and from both adapters merged. Loading is by name and idempotent: a second load adds only new names."""
    ours = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    ref = diffusers_reference(ours)
    ours.load_loras({"ink": lora_files["ink"]})
    ours.load_loras({"ink": lora_files["ink"], "sun": lora_files["sun"]})  # ink again: skipped, sun: loaded
    assert ours.loras == {"ink": lora_files["ink"], "sun": lora_files["sun"]}
    full = ours.generate([_req((("ink", 1.0),))])[0]
    both = ours.generate([_req((("ink", 0.5), ("sun", 1.0)))])[0]
    ours.fuse_lora("ink", 0.5)
    assert ours.fused_lora == ("ink", 0.5) and ours.loras == {}
    got = ours.generate([_req()])[0]
    ref.load_lora_weights(lora_files["ink"], adapter_name="ink")
    ref.fuse_lora(components=["transformer"], lora_scale=0.5, adapter_names=["ink"])
    ref.unload_lora_weights()
    lat, _ = run_flux_pipeline(ref, [_req()])
    assert (got.latents - lat[0]).abs().max() < 1e-4
    assert (got.latents - full.latents).abs().max() > 1e-2 and (got.latents - both.latents).abs().max() > 1e-2
    conv = load_pipeline(str(tiny_path), device="cpu", dtype=torch.float32)
    conv.convert_for_high(fused_projections=True)
    with pytest.raises(ValueError) as exc:
        conv.load_loras({"ink": lora_files["ink"]})
    assert str(exc.value) == ("load LoRAs before converting for high: the adapters target the unfused bf16 linears, "
                              "or serve them beside the converted layers (enable_adapter_slots)")


@pytest.mark.gpu
def test_gpu_lossless_with_adapters_replays_one_graph_per_adapter_set_byte_identical(
        tiny_path: Path, lora_files: dict[str, str]) -> None:
    """On CUDA in bf16, the lossless pool with PEFT adapters and CUDA graphs: each adapter set (names and scales) is
    captured once and replays the eager kernels, so every image equals the eager pipeline's (latents and PNG bytes,
    hence stock diffusers'); a set seen before replays without a capture. Would catch one set's graph replayed for
    another (wrong scale or adapter baked in)."""
    def build():
        pipe = load_pipeline(str(tiny_path), device="cuda", dtype=torch.bfloat16)
        pipe.load_loras(lora_files)
        return pipe

    graphed, eager = build(), build()
    sg = graphed.enable_cuda_graphs(max_graphs=8)
    sets = ((("ink", 1.0),), (("ink", 0.5),), (("ink", 1.0), ("sun", 0.7)), (), (("ink", 1.0),))
    for loras in sets:
        got, want = graphed.generate([_req(loras)])[0], eager.generate([_req(loras)])[0]
        assert got.ran.graphed and torch.equal(got.latents, want.latents) and got.png == want.png, loras
    assert sg.captures == 4 and sg.eager_fallbacks == 0, sg.stats()
