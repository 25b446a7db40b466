"""LoRA adapters loaded and unloaded while a pipeline serves (model/adapters.py, `FluxServePipeline.add_lora /
remove_lora / sync_loras`), unsharded and on TP ranks: an adapter loaded at runtime computes exactly what the same
adapter loaded at start does (`torch.equal`), so lossless stays byte-identical to stock diffusers with it; removing
one frees its layers and leaves the others exact. (The HTTP API: tests/test_serve.py, `-k runtime_adapters`.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from model.adapters import text_adapters  # noqa: E402
from model.loading import load_pipeline  # noqa: E402
from model.pipeline import GenerationRequest  # noqa: E402
from tests._inputs import write_random_lora  # noqa: E402

# (fog before ink too: PEFT adds the active adapters' terms in the order they are set, so an adapter nested in its
# own PEFT layer around another instead of joining it would round differently)
SETS = ((("fog", 0.7),), (("ink", 0.5), ("fog", 1.0)), (("fog", 1.0), ("ink", 0.5)), (("ink", 1.0),), ())


def _req(loras: tuple = (), seed: int = 5) -> GenerationRequest:
    return GenerationRequest("a red fox", height=64, width=64, steps=2, seed=seed, loras=loras)


@pytest.fixture(scope="module")
def files(tiny_path: Path, tmp_path_factory) -> dict[str, str]:
    """Two adapters of different ranks over partly different layers (fog also reaches the GELU up-projection, which
    ink does not: loaded at runtime, fog wraps layers no adapter wrapped yet and joins ink's PEFT layers; fog also
    has a CLIP part, which goes into the real text encoder)."""
    d = tmp_path_factory.mktemp("runtime-loras")
    pipe = load_pipeline(str(tiny_path))
    t = pipe.transformer
    return {"ink": str(write_random_lora(t, d / "ink.safetensors", 1)),
            "fog": str(write_random_lora(t, d / "fog.safetensors", 2, rank=8,
                                         targets=("attn.to_k", "ff.net.0.proj", "proj_out", "norm1.linear"),
                                         text_encoder=pipe.pipe.text_encoder))}


@pytest.fixture(scope="module")
def at_start(tiny_path: Path, files: dict[str, str]):
    pipe = load_pipeline(str(tiny_path))
    pipe.load_loras(files)
    return pipe


def _lora_layers(pipe, name: str) -> list[str]:
    return sorted(n for n, m in pipe.transformer.named_modules() if name in getattr(m, "lora_A", {}))


def test_an_adapter_loaded_while_serving_computes_what_one_loaded_at_start_does(
        tiny_path: Path, files: dict[str, str], at_start) -> None:
    pipe = load_pipeline(str(tiny_path))
    pipe.load_loras({"ink": files["ink"]})
    reached = pipe.add_lora("fog", files["fog"])
    assert sorted(reached) == _lora_layers(at_start, "fog") == _lora_layers(pipe, "fog")
    assert "transformer_blocks.0.ff.net.0.proj" in reached and "transformer_blocks.0.norm1.linear" in reached
    assert pipe.loras == files and pipe.form.techniques() >= {"lora"}
    for loras in SETS:
        got, want = pipe.generate([_req(loras)])[0], at_start.generate([_req(loras)])[0]
        assert torch.equal(got.latents, want.latents) and got.png == want.png, loras
    # one PEFT layer per linear holds every adapter that reaches it, as diffusers' own loading leaves it
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in pipe.transformer.modules() if isinstance(m, BaseTunerLayer)]
    assert not any(isinstance(m.get_base_layer(), BaseTunerLayer) or isinstance(m.base_layer, BaseTunerLayer)
                   for m in layers)
    assert sorted(pipe.transformer.get_submodule("single_transformer_blocks.0.proj_out").lora_A) == ["fog", "ink"]
    # the adapter's tensors are where PEFT puts them for a served model: the base layer's device and dtype
    layer = pipe.transformer.get_submodule("transformer_blocks.0.attn.to_k")
    assert layer.lora_A["fog"].weight.device.type == "cpu" and layer.lora_A["fog"].weight.dtype == torch.float32


def test_removing_an_adapter_frees_its_layers_and_leaves_the_others_exact(
        tiny_path: Path, files: dict[str, str], at_start) -> None:
    pipe = load_pipeline(str(tiny_path))
    pipe.sync_loras(files)
    # diffusers' own view: both configs, and its adapter calls work (they check its "loaded" flag)
    assert set(pipe.transformer.peft_config) == {"fog", "ink"} and pipe.transformer.active_adapters()
    assert pipe.sync_loras(files) == {"added": [], "removed": []}  # nothing to do
    assert pipe.sync_loras({"ink": files["ink"]}) == {"added": [], "removed": ["fog"]}
    assert _lora_layers(pipe, "fog") == [] and "fog" not in pipe.transformer.peft_config
    assert text_adapters(pipe.pipe) == set()  # its CLIP part went too
    got, want = pipe.generate([_req((("ink", 0.5),))])[0], at_start.generate([_req((("ink", 0.5),))])[0]
    assert torch.equal(got.latents, want.latents)
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        pipe.generate([_req((("fog", 1.0),))])
    # the same name from another file is a reload, not a stale copy
    assert pipe.sync_loras({"ink": files["fog"]}) == {"added": ["ink"], "removed": ["ink"]}
    got = pipe.generate([_req((("ink", 0.7),))])[0]
    assert torch.equal(got.latents, at_start.generate([_req((("fog", 0.7),))])[0].latents)


def test_runtime_adapters_are_refused_on_a_converted_or_fused_transformer(tiny_path: Path,
                                                                          files: dict[str, str]) -> None:
    fused = load_pipeline(str(tiny_path))
    fused.load_loras({"ink": files["ink"]})
    fused.fuse_lora("ink")
    with pytest.raises(ValueError, match="converted transformer or one with a fused adapter"):
        fused.add_lora("fog", files["fog"])
    pipe = load_pipeline(str(tiny_path))
    pipe.add_lora("fog", files["fog"])
    with pytest.raises(ValueError, match="loaded already"):
        pipe.add_lora("fog", files["ink"])
    with pytest.raises(ValueError, match="no_such_block"):  # diffusers says which layers it did not find
        pipe.add_lora("other", str(_foreign_lora(Path(files["ink"]).parent)))
    before = pipe.generate([_req((("fog", 1.0),))])[0]
    for kind in ("widened", "norms"):  # a Control LoRA would change the skeleton only
        with pytest.raises(ValueError, match="reshapes the model"):
            pipe.add_lora("control", str(_control_lora(Path(files["ink"]).parent, pipe.transformer, kind)))
    assert pipe.loras == {"fog": files["fog"]} and "control" not in pipe.transformer.peft_config
    assert torch.equal(pipe.generate([_req((("fog", 1.0),))])[0].latents, before.latents)


def _control_lora(folder: Path, transformer: torch.nn.Module, kind: str) -> Path:
    """What FLUX Control LoRAs carry beside LoRA pairs: an input projection taking twice the channels ("widened"),
    or new QK-norm weights ("norms")."""
    from safetensors.torch import save_file

    x = transformer.x_embedder
    path = folder / f"control-{kind}.safetensors"
    if kind == "widened":
        sd = {"transformer.x_embedder.lora_A.weight": torch.ones(2, 2 * x.in_features),
              "transformer.x_embedder.lora_B.weight": torch.ones(x.out_features, 2)}
    else:
        q = transformer.transformer_blocks[0].attn.to_q
        sd = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, q.in_features),
              "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(q.out_features, 2),
              "transformer.transformer_blocks.0.attn.norm_q.weight": torch.full(
                  transformer.transformer_blocks[0].attn.norm_q.weight.shape, 2.0)}
    save_file(sd, str(path))
    return path


def test_an_adapter_loaded_while_serving_kontext_edits_as_one_loaded_at_start(kontext_path: Path,
                                                                              files: dict[str, str]) -> None:
    """The runtime path is the family's own loader: a FLUX.1 Kontext pipeline takes it too."""
    from tests._inputs import random_png

    start, runtime = load_pipeline(str(kontext_path)), load_pipeline(str(kontext_path))
    start.load_loras({"fog": files["fog"]})
    runtime.add_lora("fog", files["fog"])
    edit = GenerationRequest("make it red", height=64, width=64, steps=2, seed=3, image=random_png(1), strength=1.0,
                             loras=(("fog", 0.8),))
    assert torch.equal(runtime.generate([edit])[0].latents, start.generate([edit])[0].latents)


def _foreign_lora(folder: Path) -> Path:
    """An adapter for layers this transformer does not have."""
    from safetensors.torch import save_file

    path = folder / "foreign.safetensors"
    save_file({"transformer.no_such_block.proj.lora_A.weight": torch.ones(2, 8),
               "transformer.no_such_block.proj.lora_B.weight": torch.ones(8, 2)}, str(path))
    return path


def _tp_rank(rank: int, port: int, folder: str, outdir: str) -> None:
    from tests.test_tp import GROUP_TIMEOUT_S, WORLD, report_rank

    def body(res: dict) -> None:
        import json

        from model.build import build_pipeline
        from model.form import ServingForm
        from tp.shard import shard_transformer
        from tp.worker import TPWorker

        torch.set_num_threads(1)
        files = json.loads((Path(outdir) / "files.json").read_text())
        worker = TPWorker(rank, WORLD, ServingForm(folder, loras=(("ink", files["ink"]),)), port=port,
                          backend="gloo", timeout_s=GROUP_TIMEOUT_S)
        worker.setup()
        res["sync"] = worker.sync_loras(files)
        res["runtime"] = {loras: worker.generate([_req(loras)]) for loras in SETS}
        start = build_pipeline(ServingForm(folder, loras=tuple(files.items())),
                               shard=lambda t: shard_transformer(t, rank, WORLD, worker.group))
        res["start"] = {loras: start.generate([_req(loras)]) for loras in SETS}
        res["unsync"] = worker.sync_loras({"fog": files["fog"]})
        res["fog_only"] = worker.generate([_req((("fog", 0.7),))])

    report_rank(rank, outdir, body)


def test_tp2_ranks_load_and_unload_an_adapter_while_serving_as_they_do_at_start(
        tiny_path: Path, files: dict[str, str], at_start, tmp_path: Path) -> None:
    """Every rank loads the adapter and shards it like one loaded before sharding (column: B's rows, row: A's
    columns with the rank-r all-reduce): equal to the same adapters loaded at start on the same group, and close to
    tp 1."""
    import json

    from tests.test_tp import JOIN_TIMEOUT_S, WORLD, spawn_ranks

    (tmp_path / "files.json").write_text(json.dumps(files))
    run = spawn_ranks(_tp_rank, WORLD, tiny_path, tmp_path, JOIN_TIMEOUT_S)
    assert run[0]["sync"] == run[1]["sync"] == {"added": ["fog"], "removed": []}
    for loras in SETS:
        (got,), (want,) = run[0]["runtime"][loras], run[0]["start"][loras]
        assert torch.equal(got.latents, want.latents), loras
        torch.testing.assert_close(got.latents, at_start.generate([_req(loras)])[0].latents, rtol=1e-4, atol=1e-4)
    assert run[0]["unsync"] == {"added": [], "removed": ["ink"]}
    assert torch.equal(run[0]["fog_only"][0].latents, run[0]["start"][(("fog", 0.7),)][0].latents)


def test_the_registry_takes_files_in_its_folder_only_and_keeps_its_set(tmp_path: Path) -> None:
    from deployments.adapters import STATE_FILE, AdapterStore, NotFound
    from deployments.errors import BadRequest

    folder = tmp_path / "loras"
    (folder / "sub").mkdir(parents=True)
    for f in ("fog.safetensors", "sub/ink.safetensors", "notes.txt"):
        (folder / f).write_bytes(b"x")
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    (folder / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    store = AdapterStore(str(folder), ["cfg"], max_count=2)
    assert store.add("fog", "fog.safetensors") == {"fog": str(folder / "fog.safetensors")}
    for name, file, param, message in (
            ("x", "../outside.safetensors", "file", "outside the adapter folder"),
            ("x", str(tmp_path / "outside.safetensors"), "file", "outside the adapter folder"),
            ("x", "link.safetensors", "file", "outside the adapter folder"),  # a link out of it, resolved
            ("x", "notes.txt", "file", "not a .safetensors file"),
            ("x", "gone.safetensors", "file", "no file 'gone.safetensors'"),
            ("x", "", "file", "must name a .safetensors file"),
            ("x", "fog\0.safetensors", "file", "must name a .safetensors file"),
            ("a b", "fog.safetensors", "name", "1-64 of letters"),
            ("fog", "fog.safetensors", "name", "loaded already; delete it first"),
            ("cfg", "fog.safetensors", "name", "loaded already (args.loras)")):
        with pytest.raises(BadRequest) as exc:
            store.add(name, file)
        assert (exc.value.param, message in exc.value.message) == (param, True), exc.value.message
    store.add("ink", "sub/ink.safetensors")
    with pytest.raises(BadRequest) as exc:
        store.add("more", "fog.safetensors")
    assert (exc.value.param, exc.value.message) == (None, "at most 2 adapters may be loaded through the API "
                                                          "(args.limits.max_runtime_adapters); delete one first")
    # a restarted registry knows the set; a file gone since is dropped
    assert AdapterStore(str(folder), [], 2).list() == store.list()
    (folder / "fog.safetensors").unlink()
    assert AdapterStore(str(folder), [], 2).list() == {"ink": str(folder / "sub" / "ink.safetensors")}
    assert store.remove("fog") == {"ink": str(folder / "sub" / "ink.safetensors")}
    with pytest.raises(NotFound) as exc:
        store.remove("cfg")
    assert str(exc.value) == "no adapter 'cfg' loaded through the API (it is args.loras', loaded at start)"
    with pytest.raises(NotFound) as exc:
        store.remove("fog")
    assert str(exc.value) == "no adapter 'fog' loaded through the API"
    # the set is written whole, by rename: no temporary file is left beside it
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == [STATE_FILE]
    (folder / STATE_FILE).write_text("[1, 2]")  # not a set this registry wrote: ignored, not fatal
    assert AdapterStore(str(folder), [], 2).list() == {}
