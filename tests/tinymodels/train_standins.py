"""Train a bench stand-in (``standins.py``) with rectified flow on captioned scenes, on the CPU.

    .venv/bin/python tests/tinymodels/train_standins.py --family flux --threads 1   # the shipped weights
    .venv/bin/python tests/tinymodels/train_standins.py --family wan --eval   # only the shipped weights' curve

Builds the host's real class at the stand-in's config (no weights), draws a pool of scenes
(``standin_scenes.py``, seeded) at twice the bench's 16x16 latent, encodes their captions with the tiny
CLIP (``tiny_clip(0)``; 15% of captions dropped, so CFG has something to work with), and trains for the
family's number of steps (:data:`STEPS`, batch 16): AdamW with warm-up and cosine decay, sigmas drawn
logit-normal (Flux: half of them shifted by its sampler's exp(1.15), where its early steps are),
pictures flipped left-right half the time, an EMA of the weights kept, the time embedding started
smooth (:func:`smooth_time_init`). Flux starts as the identity (:func:`identity_init`: adaLN-Zero
blocks, the output layer the inverse of the patch embedding) with its final modulation fitted so that it
returns +input at pure noise and -input at the end (:func:`flux_output_gain_init`): its residual then
grows over the early steps and shrinks over the last ones, as FLUX.1-dev's does. A second loss term
(:func:`residual_profile`, weight ``--profile-weight``) holds the log norm of the blocks' residual (what
the step caches measure) against sigma to the published curve's, up to a free scale: a tiny model
denoising flat procedural pictures keeps a large residual to the end (it can still tell the last noise
from the picture, which a real model on real latents cannot), so its ratios rose over the last steps
where the real models' fall. Writes the EMA weights in fp16
(``bench/models/<family>_standin.safetensors``), loads them back through ``standins.load_standin`` and
prints their calibrated magnitude-ratio curve (TeaCache Calibrate node, the published table's step
count) and its ``curve_match``. One thread is the better choice on a machine that others load.
"""

from __future__ import annotations

import argparse
import importlib
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rkharness  # noqa: E402

rkharness.bootstrap()
S = importlib.import_module(rkharness.TINY.__name__ + ".standins")
scenes = importlib.import_module(rkharness.TINY.__name__ + ".standin_scenes")
init_weights = importlib.import_module(rkharness.TINY.__name__ + ".trained_flux").init_weights
# the shift of half the training sigmas: Flux's sampler's own (exp(1.15)); Wan none (its curve came out
# right unshifted, as the demo Wan's; at its sampler's 8 the low-noise end was starved and rose)
SHIFTS = {"flux": math.exp(1.15), "wan": 1.0}
INIT = {"flux": "identity", "wan": "plain"}
STEPS = {"flux": 1500, "wan": 1600}  # 13 minutes each on one thread, both at once on this 2-core machine


def identity_init(net, family: str) -> None:
    """Start as the identity, as DiTs are trained (adaLN-Zero): every block's modulation zero (its gates
    shut: it adds nothing) and the output layer the inverse of the patch embedding, so before training
    the model returns its input through the residual stream and the blocks learn only what it lacks."""
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.startswith(("double_blocks.", "single_blocks.")) and ("_mod.lin." in name or "modulation.lin." in name):
                p.zero_()
            elif name.startswith("blocks.") and (name.endswith(".modulation") or ".cross_attn.o." in name):
                p.zero_()  # Wan's cross-attention has no gate: its output projection starts at zero
            elif name.startswith("time_projection."):
                p.zero_()
        if family == "flux":
            w_in, out = net.img_in.weight, net.final_layer.linear
            inv = torch.linalg.pinv(w_in)  # (c ph pw) order on both sides
        else:
            w_in, out = net.patch_embedding.weight.flatten(1), net.head.head
            inv = torch.linalg.pinv(w_in)  # rows (c, pt, ph, pw); the head emits (pt, ph, pw, c)
            inv = inv.view(net.out_dim, -1, inv.shape[1]).transpose(0, 1).reshape(inv.shape)
        # the final norm makes each token unit-variance: scale back by the embedding's gain
        out.weight.copy_(inv * w_in.norm(dim=1).pow(2).mean().sqrt())
        out.bias.zero_()


def smooth_time_init(net, family: str) -> None:
    """Zero the time embedding's weights on its sinusoids that swing faster than half the schedule (period
    under 0.5 in sigma; they may still learn). Left random, they make the residual jump from one step to
    the next (ratios alternating by +-10% on a briefly trained model), which long training would only
    slowly undo; real models' curves are smooth."""
    if family == "flux":  # timestep_embedding(sigma, 256, time_factor=1000): [cos | sin] of 128 frequencies
        layer, half, base, scale = net.time_in.in_layer, 128, 10000.0, 1000.0
    else:  # sinusoidal_embedding_1d(freq_dim, sigma * 1000)
        layer, half, base, scale = net.time_embedding[0], net.freq_dim // 2, 10000.0, 1000.0
    freqs = base ** (-torch.arange(half, dtype=torch.float64) / half) * scale
    fast = (2 * math.pi / freqs < 0.5).repeat(2)
    with torch.no_grad():
        layer.weight[:, fast] = 0.0


def flux_output_gain_init(net, pooled: torch.Tensor) -> None:
    """Flux's final modulation set (least squares over sigma and captions) so that the identity's output
    becomes g(sigma) * input, g = (2 sigma - 1) / ((1 - sigma)^2 + sigma^2): the velocity a unit-variance
    picture would want, +input at pure noise, -input at the end. The residual then carries what lies
    between, most in mid-schedule and least at both ends, as FLUX.1-dev's does."""
    from comfy.ldm.flux.layers import timestep_embedding

    sig = torch.linspace(0.0, 1.0, 101).repeat_interleave(8)
    y = pooled[torch.randint(0, pooled.shape[0], (sig.shape[0],), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        vec = net.time_in(timestep_embedding(sig, 256)) + net.vector_in(y)
        feats = torch.nn.functional.silu(vec).double()
        gain = (2 * sig - 1) / ((1 - sig) ** 2 + sig ** 2)
        design = torch.cat([feats, torch.ones(len(sig), 1, dtype=torch.float64)], 1)
        ridge = 1e-3 * torch.eye(design.shape[1], dtype=torch.float64)
        sol = torch.linalg.solve(design.T @ design + ridge, design.T @ (gain - 1).double())
        lin, hidden = net.final_layer.adaLN_modulation[1], net.hidden_size
        lin.weight.zero_()
        lin.bias.zero_()
        lin.weight[hidden:] = sol[:-1].float()  # (shift, scale): every channel's scale the same
        lin.bias[hidden:] = float(sol[-1])


def residual_profile(family: str):
    """sigma -> the log residual norm the published curve implies there (up to a constant): the published
    table's cumulative log ratios, step i placed at the sigma the stand-in's own sampler (its shift, the
    simple schedule) gives step i of that step count, linear between steps, held beyond both ends."""
    import comfy.samplers

    ratios = S.published_ratios(family)["cond"]
    ms = S.load_standin(family, load_weights=False).model.model_sampling
    sig = comfy.samplers.calculate_sigmas(ms, "simple", len(ratios))[:-1].float().flip(0)  # rising
    cum = torch.tensor(ratios, dtype=torch.float64).log().cumsum(0).float().flip(0)

    def at(s: torch.Tensor) -> torch.Tensor:
        s = s.clamp(float(sig[0]), float(sig[-1]))
        i = (torch.searchsorted(sig, s, right=True) - 1).clamp(0, len(sig) - 2)
        w = (s - sig[i]) / (sig[i + 1] - sig[i])
        return cum[i] + w * (cum[i + 1] - cum[i])

    return at


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def stack_taps(net, family: str) -> dict:
    """Hooks that keep what the block stack takes in and hands out (image tokens) on every forward: the
    residual the step caches measure (``out - in``)."""
    tap = {}
    first, last = (net.double_blocks[0], net.final_layer) if family == "flux" else (net.blocks[0], net.head)
    first.register_forward_pre_hook(lambda m, a, kw: tap.__setitem__("in", (kw["img"] if "img" in kw else a[0]).clone()),
                                    with_kwargs=True)
    last.register_forward_pre_hook(lambda m, a: tap.__setitem__("out", a[0]))
    return tap


def encode(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    import nodes

    clip = rkharness.TINY.tiny_clip(0)
    ctx, pooled = [], []
    with torch.inference_mode():
        for text in texts:
            (cond,) = nodes.CLIPTextEncode().encode(clip, text)
            ctx.append(cond[0][0][0].clone())
            pooled.append(cond[0][1]["pooled_output"][0].clone())
    return torch.stack(ctx), torch.stack(pooled)


def make_data(n: int, seed: int):
    """(pictures (n, 4, 32, 32), caption index per picture, context, pooled); the last caption is empty."""
    rng = random.Random(seed)
    descs = [scenes.scene(rng) for _ in range(n)]
    pics = torch.stack([scenes.draw(d, 2 * S.LATENT, rng) for d in descs])
    texts = sorted({scenes.caption(d) for d in descs})
    where = {t: i for i, t in enumerate(texts)}
    ctx, pooled = encode(texts + [""])
    return pics, torch.tensor([where[scenes.caption(d)] for d in descs]), ctx, pooled


def sample_sigmas(n: int, shift: float) -> torch.Tensor:
    """Logit-normal t, half of them shifted as the sampler shifts its schedule (where its steps are) and
    half not (the low-noise end, which the shift starves: the last steps of a run); 10% uniform."""
    t = torch.sigmoid(torch.randn(n))
    t = torch.where(torch.rand(n) < 0.1, torch.rand(n), t)
    s = torch.where(torch.rand(n) < 0.5, torch.full((n,), float(shift)), torch.ones(n))
    return s * t / (1 + (s - 1) * t)


def train(args) -> None:
    torch.manual_seed(args.seed)
    t0 = time.monotonic()
    pics, idx, ctx, pooled = make_data(args.pool, args.seed)
    empty = ctx.shape[0] - 1
    print(f"{args.pool} scenes, {empty} captions, drawn and encoded in {time.monotonic() - t0:.0f}s", flush=True)
    net = S.load_standin(args.family, load_weights=False).model.diffusion_model
    init_weights(net, args.seed)
    smooth_time_init(net, args.family)
    if (args.init or INIT[args.family]) == "identity":
        identity_init(net, args.family)
        if args.family == "flux":
            flux_output_gain_init(net, pooled)
    net.train()
    tap, profile = stack_taps(net, args.family), residual_profile(args.family)
    print(f"{args.family}: {sum(p.numel() for p in net.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    ema = [p.detach().clone() for p in net.parameters()]
    budget, t0, step, avg, avg_shape = args.minutes * 60, time.monotonic(), 0, None, None
    while step < args.steps and time.monotonic() - t0 < budget:
        frac = step / args.steps
        for g in opt.param_groups:  # warm up, then cosine decay to a tenth
            g["lr"] = args.lr * min(1.0, (step + 1) / 200) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        sel = torch.randint(0, pics.shape[0], (args.batch,))
        pic = pics[sel]
        flip = torch.rand(args.batch) < 0.5
        pic = torch.where(flip.view(-1, 1, 1, 1), pic.flip(-1), pic)
        x0 = S.picture_to_model_space(pic)
        ci = torch.where(torch.rand(args.batch) < 0.15, empty, idx[sel])
        s = sample_sigmas(args.batch, args.shift or SHIFTS[args.family])
        noise = torch.randn_like(x0)
        xt = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * noise
        # Flux's blocks add residuals in place: autograd keeps a copy of every tensor it saves.
        # (torch's allow_mutation_on_saved_tensors matches saved tensors by id, address and version; with
        # the profile term, backward was once handed a freed tensor's copy of another shape, a shape
        # error after 400-600 steps. Copies at saving give the same gradients, without that matching.)
        with torch.autograd.graph.saved_tensors_hooks(torch.Tensor.clone, _same):
            if args.family == "wan":  # one latent frame; Wan's sampler feeds sigma * 1000
                v = net(xt.unsqueeze(2), s * 1000, ctx[ci], transformer_options={}).squeeze(2)
            else:
                v = net(xt, s, ctx[ci], y=pooled[ci], transformer_options={})
            loss = torch.nn.functional.mse_loss(v, noise - x0)
            # the residual's norm against sigma held to the published curve's (free scale: batch-centred)
            dev = 0.5 * ((tap["out"] - tap["in"]).flatten(1).pow(2).sum(1) + 1e-6).log() - profile(s)
            shape = (dev - dev.mean()).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            (loss + args.profile_weight * shape).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(0.999, (1 + step) / (10 + step))
            for e, p in zip(ema, net.parameters(), strict=True):
                e.mul_(decay).add_(p.detach(), alpha=1 - decay)
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        avg_shape = shape.item() if avg_shape is None else 0.98 * avg_shape + 0.02 * shape.item()
        step += 1
        if step % 100 == 0:
            print(f"step {step} loss {avg:.4f} shape {avg_shape:.4f} {time.monotonic() - t0:.0f}s", flush=True)
        if args.eval_every and step % args.eval_every == 0:  # a checkpoint, and how its curve looks
            save(net, ema, Path(args.out))
            # in another process: the step cache's patches stay installed after a calibration run
            subprocess.run([sys.executable, __file__, "--family", args.family, "--eval", "--threads", "1",
                            "--out", args.out], check=True)
    print(f"trained {step} steps in {time.monotonic() - t0:.0f}s, loss {avg:.4f}", flush=True)
    save(net, ema, Path(args.out))


def save(net, ema: list[torch.Tensor], out: Path) -> None:
    """The EMA weights (buffers as they are) in fp16."""
    from safetensors.torch import save_file

    names = [n for n, _ in net.named_parameters()]
    state = {**net.state_dict(), **dict(zip(names, ema, strict=True))}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}, str(out))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)", flush=True)


def evaluate(family: str, weights: str) -> None:
    """The calibrated ratio curve of the weights at the published step count, and its curve_match."""
    model = S.load_standin(family, weights)
    steps = S.PUBLISHED_STEPS[family]
    mags = S.calibrated_magnitudes(model, family, steps)
    for label, points in sorted(mags.items()):
        print(f"{label:6s} " + " ".join(f"{r:.3f}" for r in S.step_ratios(points)))
    published = S.published_ratios(family)["cond"]
    print("publ.  " + " ".join(f"{r:.3f}" for r in S.resampled_ratios(published, steps)))
    print(f"RESULT family={family} curve_match={S.curve_match(family, mags):.4f} "
          f"flat={S.flat_match(family):.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True, choices=tuple(S.CONFIGS))
    ap.add_argument("--minutes", type=float, default=90.0, help="stop after this long all the same")
    ap.add_argument("--steps", type=int, default=0, help="at most this many optimiser steps (0: the family's)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pool", type=int, default=6000, help="scenes drawn for training")
    ap.add_argument("--shift", type=float, default=0.0, help="sigma shift of half the training sigmas "
                    "(0: the family's)")
    ap.add_argument("--init", choices=("plain", "identity"), help="plain: random blocks, zero output layer; "
                    "identity: adaLN-Zero blocks, output layer the embedding's inverse (default: the family's)")
    ap.add_argument("--profile-weight", type=float, default=1.0, help="weight of the residual-norm profile "
                    "term (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0, help="save and print the curve every N steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="weights file (default: the shipped stand-in of the family)")
    ap.add_argument("--eval", action="store_true", help="only print the curve of --out (or the shipped weights)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out = args.out or str(S.weights_path(args.family))
    args.steps = args.steps or STEPS[args.family]
    if not args.eval:
        train(args)
    evaluate(args.family, args.out)


if __name__ == "__main__":
    main()
