"""The conditioning cache on CUDA: encoders on the GPU stay exact; device outputs are stored as CPU
copies and returned as private copies on their device."""

import pytest
import rkharness
import torch

pytestmark = [pytest.mark.conditioning, pytest.mark.gpu]


@pytest.fixture
def cc():
    cc = rkharness.pack("caching.conditioning")
    rkharness.pack("caching.stats").REGISTRY.clear("conditioning")
    yield cc
    rkharness.pack("caching.stats").REGISTRY.clear("conditioning")


def test_gpu_encoders_hit_bit_exact_also_after_an_offload(cc, tiny):
    """Inference-tensor weights (as ComfyUI's loaders make them) on the GPU: hits are bit-exact, and
    after ComfyUI offloads the encoder to the CPU (and the next encode finds it there or loads it
    back) the encode is still a hit: a move between devices is never an edit."""
    import comfy.model_management as mm

    with torch.inference_mode():
        clip, vae = tiny.tiny_clip(0), tiny.tiny_vae(0)
    assert all(w.is_inference() for w in clip.cond_stage_model.parameters())
    tokens = clip.tokenize("a (red:1.3) square")
    first = clip.encode_from_tokens(tokens, return_pooled=True)
    assert clip.patcher.load_device.type == "cuda"
    hits = cc.CACHE.count("hits")
    again = clip.encode_from_tokens(tokens, return_pooled=True)
    assert cc.CACHE.count("hits") == hits + 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for _ in range(2):
        mm.unload_all_models()
        hits = cc.CACHE.count("hits")
        after = clip.encode_from_tokens(tokens, return_pooled=True)
        assert cc.CACHE.count("hits") == hits + 1 and all(torch.equal(a, b) for a, b in zip(after, first))
        mm.load_models_gpu([clip.patcher])
        hits = cc.CACHE.count("hits")
        after = clip.encode_from_tokens(tokens, return_pooled=True)
        assert cc.CACHE.count("hits") == hits + 1 and all(torch.equal(a, b) for a, b in zip(after, first))

    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    latent = vae.encode(image)
    hits = cc.CACHE.count("hits")
    assert torch.equal(vae.encode(image), latent) and cc.CACHE.count("hits") == hits + 1


def test_device_outputs_are_stored_on_the_cpu_and_returned_on_their_device(cc, tiny):
    """An encoder that returns device tensors (--gpu-only): the entry holds a CPU copy, every hit a
    private copy on the encoder's device."""
    clip = tiny.tiny_clip(0)
    owner = cc.identity(clip.cond_stage_model)
    value = torch.arange(4096, dtype=torch.float32, device="cuda")
    key = cc.Key("text", ("negative",), owners=(owner,))
    cc.CACHE.fetch(key, lambda: value.clone())
    (entry,) = cc.CACHE._entries.values()
    assert entry.stored[1].device.type == "cpu" and cc.CACHE.bytes_by_tier()["device"] == 0
    hit = cc.CACHE.fetch(key, lambda: pytest.fail("a hit must not recompute"))
    assert hit.device == value.device and torch.equal(hit, value)
    hit.add_(1)  # the caller owns its copy
    assert torch.equal(cc.CACHE.fetch(key, lambda: None), value)


def test_the_fingerprint_is_the_same_on_the_gpu_and_the_cpu_and_sees_edits_there(cc):
    """One fingerprint function: computed on the GPU (no host copy of the weights) it gives the CPU's
    values for the same bytes; an in-place one-element edit on the GPU changes only that weight's;
    the cheap check of weights moved to the GPU finds no edit."""
    we = rkharness.pack("caching.weight_edits")
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(1200, 1200, generator=gen), torch.randn(16, generator=gen).half(),
               torch.randn(5000, 64, generator=gen)]
    on_gpu = [w.cuda() for w in weights]
    before = we.fingerprints(on_gpu)
    assert before == we.fingerprints(weights)
    watch = we.WeightWatch()
    watch.full({str(i): w for i, w in enumerate(weights)}, embeddings=frozenset({"2"}))
    assert not watch.quick({str(i): w for i, w in enumerate(on_gpu)}, token_ids=[0, 7, 4999])
    on_gpu[1][3] += 1
    after = we.fingerprints(on_gpu)
    assert after[0] == before[0] and after[1] != before[1]
    assert watch.quick({str(i): w for i, w in enumerate(on_gpu)})


def test_a_vae_encode_whose_attention_ran_out_of_gpu_memory_is_returned_never_stored(cc, tiny, monkeypatch):
    """A real out-of-memory error of the CUDA allocator inside the VAE's attention: ComfyUI goes on with sliced
    attention (0.3.75 catches the error itself, with no hook: the allocator's count tells). That result is
    returned and counted, never stored; the next encode with room to spare is."""
    import comfy.ops

    vae = tiny.tiny_vae(0)
    attention = getattr(vae.first_stage_model.encoder.mid.attn_1, "optimized_attention", None)
    if getattr(attention, "__name__", "") != "pytorch_attention":
        pytest.skip(f"the VAE's attention here is {getattr(attention, '__name__', attention)}, not pytorch's")
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(3))
    sdpa, failed = comfy.ops.scaled_dot_product_attention, []

    def out_of_memory_once(*args, **kwargs):
        if not failed:
            failed.append(1)
            torch.empty(1 << 48, dtype=torch.uint8, device="cuda")  # the allocator's own error
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(comfy.ops, "scaled_dot_product_attention", out_of_memory_once)
    vae.encode(image)
    assert failed and len(cc.CACHE) == 0 and cc.CACHE.count("bypasses.vae") == 1
    monkeypatch.setattr(comfy.ops, "scaled_dot_product_attention", sdpa)
    plain = vae.encode(image)
    assert len(cc.CACHE) == 1 and torch.equal(vae.encode(image), plain) and cc.CACHE.count("hits.vae") == 1
