"""Train the small test Flux (see trained_flux.py) with rectified flow on procedural pictures.

    .venv/bin/python tests/tinymodels/train_flux.py [--minutes 8] [--device cpu]

On an accelerator machine without the test host, split it: ``--prepare data.pt`` here (captions
through the tiny CLIP, the picture pool), then ``--data data.pt --comfy <dir holding comfy/>
--device cuda`` there (only ComfyUI's ``comfy`` package is needed to build the real Flux class),
then ``--eval`` here. The shipped weights were trained that way (see README).

Builds the host's real Flux class (comfy.supported_models.Flux) at hidden 64, 2+2 blocks, draws
captioned shapes with PIL, encodes the captions with the tiny CLIP (tiny_clip(0)), drops 15% of
captions (so classifier-free guidance has something to work with), trains for a wall-clock budget
and writes nodes/demo_models/flux_shapes.safetensors (the demo models the pack ships). Ends with a short evaluation: how
far samples are from their caption's colours, with and without CFG.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STANDALONE = "--data" in sys.argv  # training only: no test host, ComfyUI's comfy/ package alone
if STANDALONE:
    spec = importlib.util.spec_from_file_location("rk_trained_flux", HERE / "trained_flux.py")
    T = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(T)
else:
    sys.path.insert(0, str(HERE.parent))
    import rkharness

    rkharness.bootstrap()
    T = importlib.import_module(rkharness.TINY.__name__ + ".trained_flux")
    TINY = rkharness.TINY


def encode_captions(texts):
    import nodes

    clip = TINY.tiny_clip(0)
    ctx, pooled = [], []
    with torch.no_grad():
        for text in texts:
            (cond,) = nodes.CLIPTextEncode().encode(clip, text)
            ctx.append(cond[0][0][0])
            pooled.append(cond[0][1]["pooled_output"][0])
    return torch.stack(ctx), torch.stack(pooled)


def make_pool(n, size, caps, rng):
    pics, idx = [], []
    for _ in range(n):
        i = rng.randrange(len(caps))
        _, color, shape, bg = caps[i]
        pics.append(T.draw(color, shape, bg, size, rng))
        idx.append(i)
    return torch.stack(pics), torch.tensor(idx)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--pool", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", default="flux", choices=("flux", "wan"))
    ap.add_argument("--out", help="where to write the weights (default: the shipped file of the family)")
    ap.add_argument("--prepare", help="write captions' encodings and the picture pool here, then stop")
    ap.add_argument("--data", help="train from a --prepare file (no test host needed)")
    ap.add_argument("--comfy", help="with --data: the folder that holds ComfyUI's comfy/ package")
    args = ap.parse_args()
    args.out = args.out or str(T.FAMILIES[args.family][2])
    wan = args.family == "wan"

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dev = torch.device(args.device)
    caps = T.captions()
    if args.data:
        ctx, pooled = torch.load(args.data)
    else:
        ctx, pooled = encode_captions([c[0] for c in caps] + [""])
        if args.prepare:
            torch.save((ctx, pooled), args.prepare)
            print(f"wrote {args.prepare}")
            return
    t_pool = time.monotonic()
    pics, idx = make_pool(args.pool, 16, caps, rng)
    x0_all = torch.nn.functional.pixel_unshuffle(pics * 2.0 - 1.0, 2)  # process_in space
    print(f"pool drawn in {time.monotonic() - t_pool:.1f}s")
    empty = ctx.shape[0] - 1  # the last encoding is the empty caption
    print(f"{empty} captions, pool {tuple(x0_all.shape)}, x0 std {x0_all.std():.3f}")

    if args.data:
        sys.path.insert(0, args.comfy)
        import comfy.cli_args

        comfy.cli_args.args.cpu = dev.type == "cpu"
        import comfy.ldm.flux.model
        import comfy.ops

        if wan:
            import comfy.ldm.wan.model

            cfg = {k: v for k, v in T.WAN_CONFIG.items() if k != "image_model"}
            net = comfy.ldm.wan.model.WanModel(**cfg, dtype=torch.float32, device=dev,
                                               operations=comfy.ops.disable_weight_init)
        else:
            net = comfy.ldm.flux.model.Flux(**T.CONFIG, dtype=torch.float32, device=dev,
                                            operations=comfy.ops.disable_weight_init)
    else:
        net = T.build(load_weights=False, family=args.family).model.diffusion_model
    T.init_weights(net, args.seed)
    net.to(dev).train()
    ctx, pooled, x0_all, idx = ctx.to(dev), pooled.to(dev), x0_all.to(dev), idx.to(dev)
    n_params = sum(p.numel() for p in net.parameters())
    print(f"params {n_params}")
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    budget = args.minutes * 60
    t0 = time.monotonic()
    step, ema = 0, None
    ema_params = [p.detach().clone() for p in net.parameters()]
    while time.monotonic() - t0 < budget:
        frac = (time.monotonic() - t0) / budget
        for g in opt.param_groups:  # warm up, then cosine-ish decay
            g["lr"] = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(frac * 3.14159)).item()))
        sel = torch.randint(0, x0_all.shape[0], (args.batch,), device=dev)
        x0 = x0_all[sel]
        if torch.rand(()) < 0.5:  # flips keep positions varied
            x0 = torch.flip(x0, dims=[-1])
        ci = idx[sel].clone()
        ci[torch.rand(args.batch, device=dev) < 0.15] = empty
        s = torch.sigmoid(torch.randn(args.batch, device=dev) * 1.2)
        s = torch.where(torch.rand(args.batch, device=dev) < 0.1, torch.rand(args.batch, device=dev), s)
        noise = torch.randn_like(x0)
        xt = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * noise
        # Flux's blocks add residuals in place: let autograd keep copies of what they overwrite
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            if wan:  # one latent frame; Wan's sampler feeds sigma * 1000
                v = net(xt.unsqueeze(2), s * 1000, ctx[ci], transformer_options={}).squeeze(2)
            else:
                v = net(xt, s, ctx[ci], y=pooled[ci], transformer_options={})
            loss = torch.nn.functional.mse_loss(v, noise - x0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(0.995, (1 + step) / (10 + step))
            for e, p in zip(ema_params, net.parameters()):
                e.mul_(decay).add_(p.detach(), alpha=1 - decay)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        step += 1
        if step % 200 == 0:
            print(f"step {step} loss {ema:.4f} {time.monotonic() - t0:.0f}s", flush=True)
    print(f"trained {step} steps in {time.monotonic() - t0:.0f}s, loss {ema:.4f}")
    with torch.no_grad():
        for e, p in zip(ema_params, net.parameters()):
            p.copy_(e)
    from safetensors.torch import save_file

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", torch.float16).contiguous() for k, v in net.state_dict().items()},
              args.out)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.2f} MB)")
    if not args.data:
        evaluate(args.family)


def evaluate(family="flux"):
    """Sample a few captions through the real KSampler: caption error at CFG 1 and CFG 4."""
    import nodes

    model, clip = T.build(family=family), TINY.tiny_clip(0)
    shape = (1, 16, 1, 8, 8) if family == "wan" else (1, 16, 8, 8)
    rng = random.Random(123)
    picks = rng.sample(T.captions(), 8)
    (neg,) = nodes.CLIPTextEncode().encode(clip, "")
    with torch.inference_mode():
        for cfg in (1.0, 4.0):
            errs = []
            for text, color, _, bg in picks:
                (pos,) = nodes.CLIPTextEncode().encode(clip, text)
                latent = {"samples": torch.zeros(shape)}
                (out,) = nodes.common_ksampler(model, 1, 20, cfg, "euler", "simple", pos, neg, latent)
                x = model.model.latent_format.process_in(out["samples"]).reshape(1, 16, 8, 8)
                errs.append(T.shape_color_error(x, color, bg, processed=True))
            print(f"cfg {cfg}: caption colour error {sum(errs) / len(errs):.3f} "
                  f"({' '.join(f'{e:.2f}' for e in errs)})")


if __name__ == "__main__":
    if "--eval" in sys.argv:
        evaluate("wan" if "wan" in sys.argv else "flux")
    else:
        main()
