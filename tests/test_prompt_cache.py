"""The prompt-embedding cache (model/prompt_cache.py): a repeated prompt skips the text encoders and the image stays
byte-identical to stock diffusers, which encodes every time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import prompt_cache
from model.loading import diffusers_reference, load_pipeline
from model.pipeline import GenerationRequest, edit_pipeline, run_flux_pipeline
from tests._inputs import random_png


@pytest.fixture
def fresh(tiny_path: Path):
    """Our pipeline (a cache of its own) and a count of T5 forwards."""
    pipe = load_pipeline(str(tiny_path))
    calls = []
    pipe.pipe.text_encoder_2.register_forward_hook(lambda *a: calls.append(1))
    return pipe, calls


def test_a_repeated_prompt_skips_the_text_encoders_and_stays_byte_identical(fresh) -> None:
    """Catches a key that misses an argument (a hit for another prompt, batch or images per prompt: wrong image) and
    a hit that returns embeddings a step changed in place (the second image would differ from stock diffusers)."""
    pipe, calls = fresh
    ref = diffusers_reference(pipe)
    for seed in (1, 2, 3):  # one prompt, new seeds: encoded once
        req = GenerationRequest("a lighthouse at dusk", height=64, width=64, steps=2, seed=seed)
        res = pipe.generate([req])[0]
        latents, pngs = run_flux_pipeline(ref, [req])
        assert torch.equal(res.latents, latents[0]) and res.png == pngs[0], seed
    assert len(calls) == 1 and pipe.prompt_cache.hits == 2  # (the stock reference, loaded apart, encodes each time)
    calls.clear()
    pair = [GenerationRequest(p, height=64, width=64, steps=2, seed=4) for p in ("a lighthouse at dusk", "a barn")]
    ours = run_flux_pipeline(pipe.pipe, pair)[1]
    assert len(calls) == 1 and ours == run_flux_pipeline(ref, pair)[1]  # another batch: another key
    other = GenerationRequest("a barn", height=64, width=64, steps=2, seed=4)
    assert pipe.generate([other])[0].png == run_flux_pipeline(ref, [other])[1][0]


def test_edits_share_the_cache_by_their_own_key(fresh) -> None:
    pipe, calls = fresh
    req = GenerationRequest("a lighthouse at dusk", height=64, width=64, steps=2, seed=1, image=random_png(3),
                            strength=0.6)
    first, second = (pipe.generate([req])[0].png for _ in range(2))
    assert first == second and prompt_cache.cache_of(edit_pipeline(pipe.pipe, inpaint=False)) is pipe.prompt_cache
    assert len(calls) == 1 and pipe.prompt_cache.hits == 1


def test_the_cache_keeps_its_size_and_can_be_off(fresh, monkeypatch) -> None:
    pipe, calls = fresh
    pipe.prompt_cache.size = 2
    for prompt in ("a", "b", "c", "a"):  # "a" left when "c" came in
        pipe.generate([GenerationRequest(prompt, height=64, width=64, steps=1, seed=0)])
    assert len(calls) == 4 and len(pipe.prompt_cache) == 2
    monkeypatch.setenv("FLUXSERVE_PROMPT_CACHE", "16")
    prompt_cache.disable_by_default()  # the benchmarks' switch: pipelines built after it keep nothing
    assert prompt_cache.PromptCache().size == 0 and prompt_cache.os.environ["FLUXSERVE_PROMPT_CACHE"] == "0"


class _Encoder:
    """A pipeline's `encode_prompt` stand-in: records each call's arguments and returns them."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def encode_prompt(self, prompt=None, prompt_2=None, device=None, num_images_per_prompt=1, prompt_embeds=None,
                      pooled_prompt_embeds=None, max_sequence_length=512, lora_scale=None):
        args = dict(prompt=prompt, prompt_2=prompt_2, device=device, num_images_per_prompt=num_images_per_prompt,
                    prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled_prompt_embeds,
                    max_sequence_length=max_sequence_length, lora_scale=lora_scale)
        self.calls.append(args)
        return ("embeds", len(self.calls))


class _OtherEncoder(_Encoder):
    pass


def test_the_cache_passes_every_argument_on_and_keys_on_each() -> None:
    """Unit test on a stand-in pipeline: every argument reaches the real encode_prompt as given (also its defaults);
    a call differing in any one argument, or made on another pipeline class, is another entry; a str and a
    one-prompt list are the same call; counts of hits and misses are exact; installing twice wraps once."""
    cache = prompt_cache.PromptCache(size=32)
    pipe, other = _Encoder(), _OtherEncoder()
    cache.install(pipe)
    cache.install(pipe)  # no second wrapper (a call would then count twice)
    cache.install(other)
    base = dict(prompt=["a fox"], prompt_2=["a fox, 35mm"], device="cpu", num_images_per_prompt=2,
                max_sequence_length=77, lora_scale=0.5)
    assert pipe.encode_prompt(**base) == ("embeds", 1)
    assert pipe.calls == [{**base, "prompt_embeds": None, "pooled_prompt_embeds": None}]
    assert pipe.encode_prompt(**base) == ("embeds", 1) and (cache.hits, cache.misses) == (1, 1)
    variants = [dict(prompt=["a cat"]), dict(prompt_2=None), dict(device="meta"), dict(num_images_per_prompt=1),
                dict(max_sequence_length=512), dict(lora_scale=None)]
    for i, change in enumerate(variants, start=2):
        assert pipe.encode_prompt(**{**base, **change}) == ("embeds", i), change
    assert other.encode_prompt(**base) == ("embeds", 1)  # another class: its own entry
    assert (cache.hits, cache.misses) == (1, 2 + len(variants))
    pipe.encode_prompt(prompt="a fox")
    assert pipe.calls[-1] == {**{k: None for k in base}, "prompt": "a fox", "num_images_per_prompt": 1,
                              "max_sequence_length": 512, "prompt_embeds": None, "pooled_prompt_embeds": None}
    n = len(pipe.calls)
    pipe.encode_prompt(prompt=["a fox"])  # diffusers reads a str as a one-prompt list
    assert len(pipe.calls) == n


def test_given_embeddings_are_not_kept_and_the_oldest_entry_goes_first() -> None:
    cache = prompt_cache.PromptCache(size=2)
    pipe = _Encoder()
    cache.install(pipe)
    for given in (dict(prompt_embeds="e"), dict(pooled_prompt_embeds="p")):  # either one: nothing to encode or keep
        pipe.encode_prompt(prompt="a", **given)
        pipe.encode_prompt(prompt="a", **given)
        assert all(pipe.calls[-1][k] == v for k, v in given.items())  # and what was given is passed on
    assert len(pipe.calls) == 4 and len(cache) == 0
    pipe.encode_prompt(prompt="a", prompt_embeds="e", pooled_prompt_embeds="p")
    assert (pipe.calls[-1]["prompt_embeds"], pipe.calls[-1]["pooled_prompt_embeds"]) == ("e", "p")
    pipe.calls.pop()
    for prompt in ("a", "b", "a", "c", "a", "b"):  # "a" used again before "c" came in: "b" is the oldest, it goes
        pipe.encode_prompt(prompt=prompt)
    assert [c["prompt"] for c in pipe.calls[4:]] == ["a", "b", "c", "b"] and len(cache) == 2
    one = prompt_cache.PromptCache(size=1)
    solo = _Encoder()
    one.install(solo)
    solo.encode_prompt(prompt="a")
    solo.encode_prompt(prompt="a")
    assert len(solo.calls) == 1  # a cache of one still keeps one
    with pytest.raises(ValueError, match="prompt cache size must be >= 0, got -1"):
        prompt_cache.PromptCache(-1)


def test_prompts_encoded_with_a_text_encoder_adapter_on_are_not_cached(tiny_path: Path, tmp_path: Path) -> None:
    """An adapter with a CLIP part changes the prompt's embeddings: one prompt, adapters switched on and off between
    requests, every image byte-identical to stock diffusers with the same adapters (a cache keyed by the call's
    arguments alone answers the adapted request with the plain embeddings, or the reverse)."""
    pytest.importorskip("peft")
    from tests._inputs import write_random_lora

    pipe = load_pipeline(str(tiny_path))
    ref = diffusers_reference(pipe)
    path = str(write_random_lora(pipe.transformer, tmp_path / "te.safetensors", 7, text_encoder=pipe.pipe.text_encoder))
    pipe.load_loras({"te": path})
    ref.load_lora_weights(path, adapter_name="te")
    seen = {}
    for loras in [(), (("te", 0.8),), (), (("te", 0.5),), (("te", 0.8),)]:
        req = GenerationRequest("a lighthouse at dusk", height=64, width=64, steps=2, seed=1, loras=loras)
        got = pipe.generate([req])[0]
        if loras:
            ref.enable_lora()
            ref.set_adapters([n for n, _ in loras], [s for _, s in loras])
        else:
            ref.disable_lora()
        latents, pngs = run_flux_pipeline(ref, [req])
        assert torch.equal(got.latents, latents[0]) and got.png == pngs[0], loras
        seen[loras] = got.latents
    assert pipe.prompt_cache.hits == 1  # the plain prompt, asked again; adapted calls neither hit nor filled it
    # the adapter's CLIP part matters: the same adapter on the transformer alone draws another image
    ref.set_adapters(["te"], [{"transformer": 0.8, "text_encoder": 0.0}])
    req = GenerationRequest("a lighthouse at dusk", height=64, width=64, steps=2, seed=1, loras=(("te", 0.8),))
    assert not torch.equal(run_flux_pipeline(ref, [req])[0][0], seen[(("te", 0.8),)])
