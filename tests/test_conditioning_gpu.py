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


def test_gpu_encoders_hit_bit_exact(cc, tiny):
    import comfy.model_management as mm

    clip, vae = tiny.tiny_clip(0), tiny.tiny_vae(0)
    tokens = clip.tokenize("a (red:1.3) square")
    first = clip.encode_from_tokens(tokens, return_pooled=True)
    assert clip.patcher.load_device.type == "cuda"
    hits = cc.CACHE.count("hits")
    again = clip.encode_from_tokens(tokens, return_pooled=True)
    assert cc.CACHE.count("hits") == hits + 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    mm.unload_all_models()
    assert torch.equal(clip.encode_from_tokens(tokens, return_pooled=True)[0], first[0])  # after an unload

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


def test_weights_on_the_gpu_are_fingerprinted_there_and_edits_are_seen(cc):
    """CUDA weights take the device multiply-sum (the same values as on the CPU: no host copy), and
    an in-place one-element edit on the GPU changes only that weight's fingerprint."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(1200, 1200, generator=gen), torch.randn(16, generator=gen).half()]
    on_gpu = [w.cuda() for w in weights]
    before = cc.checksums(on_gpu)
    assert before == [int(cc._device_fingerprint(w)) for w in weights]
    on_gpu[1][3] += 1
    after = cc.checksums(on_gpu)
    assert after[0] == before[0] and after[1] != before[1]
