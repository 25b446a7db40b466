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
    monkeypatch.setattr(prompt_cache, "DEFAULT_SIZE", prompt_cache.DEFAULT_SIZE)
    monkeypatch.setenv("FLUXSERVE_PROMPT_CACHE", "16")
    prompt_cache.disable_by_default()  # the benchmarks' switch: pipelines built after it keep nothing
    assert prompt_cache.PromptCache().size == 0 and prompt_cache.os.environ["FLUXSERVE_PROMPT_CACHE"] == "0"
    with pytest.raises(ValueError):
        prompt_cache.PromptCache(-1)
