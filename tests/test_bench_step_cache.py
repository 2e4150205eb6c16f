"""The step cache benchmark (bench/step_cache.py, bench/step_cache_curves.py): the protocol its sweeps keep (each run set
used where it belongs, calibration at unscored step counts, the same search for every method), the quality
metric, the Pareto curve and the speedup read off it by interpolation, the tuning pick, the methods it
ranks and the RESULT it prints."""

import importlib
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import rkharness
import torch

pytestmark = pytest.mark.step_cache

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("reusekit_bench_step_cache", BENCH / "step_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def curves(bench):
    return bench.curves


@pytest.fixture(scope="module")
def to_picture():
    return importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux").latent_to_picture


def latent_of(pic):
    shapes = importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux")
    return shapes.picture_to_latent(pic)


def pt(x, psnr, worst=None, **kw):
    return {"x": x, "psnr": psnr, "worst": psnr if worst is None else worst, **kw}


# ---- the metric --------------------------------------------------------------------------------------

def test_an_equal_picture_scores_the_cap_and_full_ssim(bench, curves, to_picture):
    ref = latent_of(torch.rand(1, 4, 64, 64, generator=torch.Generator().manual_seed(0)))
    assert bench.picture_metrics(ref.clone(), ref, to_picture) == (curves.PSNR_CAP, pytest.approx(1.0), 0.0)


def test_psnr_is_that_of_the_decoded_rgb_and_the_error_that_of_the_latent(bench, to_picture):
    gen = torch.Generator().manual_seed(1)
    pic = torch.rand(1, 4, 64, 64, generator=gen) * 0.8 + 0.1
    noisy = pic.clone()
    noisy[:, :3] += torch.randn(1, 3, 64, 64, generator=gen) * 0.05  # inside [0, 1]: no clamping
    noisy[:, 3] = 0.0  # the mask channel is not part of the picture
    ref, out = latent_of(pic), latent_of(noisy)
    psnr, ssim, err = bench.picture_metrics(out, ref, to_picture)
    mse = float(((to_picture(out)[:, :3] - to_picture(ref)[:, :3]) ** 2).mean())
    assert psnr == pytest.approx(10 * math.log10(1.0 / mse), abs=1e-3)
    assert 0.0 < ssim < 1.0
    assert err == pytest.approx(float((out - ref).norm() / ref.norm()))


def test_a_video_latent_scores_like_its_frames_side_by_side(bench, to_picture):
    """A 5-D (Wan) latent's one frame scores exactly as the same 4-D latent (SSIM sees the real layout)."""
    gen = torch.Generator().manual_seed(2)
    pic = torch.rand(1, 4, 64, 64, generator=gen)
    smooth = torch.nn.functional.avg_pool2d(pic, 9, 1, 4)  # structure, so a scrambled layout would differ
    ref, out = latent_of(smooth), latent_of(smooth * 0.9 + 0.05)
    flat = bench.picture_metrics(out, ref, to_picture)
    video = bench.picture_metrics(out.unsqueeze(2), ref.unsqueeze(2), to_picture)
    assert video == pytest.approx(flat)


# ---- tuning arithmetic ---------------------------------------------------------------------------------

def test_the_tuning_pick_is_the_fastest_setting_keeping_both_floors(curves):
    points = [pt(2.0, 40.0, 35.0, threshold=0.1), pt(3.0, 33.0, 24.0, threshold=0.2),
              pt(2.5, 31.0, 26.0, threshold=0.3), pt(4.0, 20.0, threshold=0.4)]
    assert curves.pick(points, 30.0, 25.0)["threshold"] == 0.3
    assert curves.pick(points[3:], 30.0, 25.0) is None


def test_the_plots_speedup_axis_holds_every_point(curves, tmp_path):
    assert curves.x_axis_end([2.0, 7.9]) == 8
    assert curves.x_axis_end([8.33, 3.0]) == 12
    assert curves.x_axis_end([12.5]) == 16
    assert curves.x_axis_end([40.0]) == 24  # the last tick: a faster point sits on the edge
    path = tmp_path / "p.png"
    curves.plot([("t", {"a": [pt(8.33, 30.0), pt(2.0, 40.0)]})], path, {"a": (0, 0, 0)})
    assert path.stat().st_size > 0


def test_refinement_halves_the_gap_at_the_crossing_in_log(curves):
    points = [pt(2.0, 40.0, threshold=0.1), pt(3.0, 35.0, threshold=0.2), pt(5.0, 20.0, threshold=0.4)]
    assert curves.refine(points, 30.0, 25.0, {0.1, 0.2, 0.4}) == pytest.approx(0.283)
    assert curves.refine(points, 30.0, 25.0, {0.1, 0.2, 0.4, 0.283}) is None
    assert curves.log_grid(0.01, 1.0, 3) == [0.01, 0.1, 1.0]


def test_the_bootstrap_interval_holds_the_speedup_and_is_the_same_for_the_same_runs(bench):
    calls = [10.0, 12.0, 14.0, 20.0]
    lo, hi = bench.interval(40.0, calls)
    assert lo < 40.0 / (sum(calls) / 4) < hi and (lo, hi) == bench.interval(40.0, calls)
    assert bench.interval(40.0, [10.0] * 4) == (4.0, 4.0)


# ---- the protocol -----------------------------------------------------------------------------------

class FakeBench:
    """What the protocol functions read of a Bench; every run goes through ``measure``, replaced below."""
    quick, family = False, "flux"


@pytest.fixture
def measured(bench, monkeypatch):
    """``measure`` replaced by a quality that falls as the threshold rises along the method's grid (the floors
    are missed past 3/4 of it); every call recorded with its runs."""
    calls = []

    def measure(_bench, setting, steps, runs, refs):
        th = setting.get("threshold") or 0.0
        calls.append((setting["name"], setting.get("combo"), th, tuple(runs)))
        lo, *_, hi = bench.grid(setting, quick=False)
        r = (th - lo) / (hi - lo)
        return {"x": 1.0 + 4 * r, "x_lo": 1.0, "x_hi": 1.0, "psnr": 45.0 - 20 * r, "worst": 40.0 - 20 * r,
                "threshold": setting.get("threshold")}

    monkeypatch.setattr(bench, "measure", measure)
    return calls


TUNING = [("tune a", 7), ("tune b", 7)]
EVAL = [("eval a", 1), ("eval a", 2), ("eval b", 1)]


def test_a_setting_is_chosen_on_tuning_runs_alone_and_scored_once_on_evaluation_runs(bench, measured):
    method = next(m for m in bench.methods("flux") if m["name"] == "MagCache")
    points, picked = bench.tune(FakeBench(), method, 28, TUNING, {})
    assert measured and all(runs == tuple(TUNING) for *_, runs in measured)  # tuning never sees an evaluation run
    assert picked is not None and bench.keeps(picked) and picked["x"] == max(p["x"] for p in points if bench.keeps(p))
    measured.clear()
    scored = bench.score(FakeBench(), method, 28, picked, EVAL, {})
    assert [(th, runs) for _, _, th, runs in measured] == [(picked["threshold"], tuple(EVAL))]  # once, at the pick
    assert scored["combo"] == picked["combo"]


def test_a_method_whose_tuning_kept_nothing_scores_as_uncached(bench, measured):
    method = next(m for m in bench.methods("flux") if m["name"] == "MagCache")
    scored = bench.score(FakeBench(), method, 28, None, EVAL, {})
    assert (scored["x"], measured) == (1.0, [])


def test_every_method_sweeps_every_combo_over_its_grid(bench, measured):
    """The first combo (no skip limit, no window) walks from the grid's start; each restricted combo from the
    first one's pick (below it a restriction only computes more), each past the pick to a setting that
    misses the floors, or (an interval under a skip limit K) to the first interval above K, whose beat every
    larger one runs. Baselines and ReuseKit's rules alike."""
    for method in [m for m in bench.methods("flux") if not m.get("defaults")]:
        measured.clear()
        points, picked = bench.tune(FakeBench(), method, 28, TUNING, {})
        combo = lambda c: str(c if "core" in method else bench.combos("flux")[c])  # noqa: E731
        tried = {(str(c), th) for _, c, th, _ in measured}
        assert {c for c, _ in tried} == {combo(c) for c in method["combos"]}, method["name"]
        first = bench.grid(method, quick=False)
        free = [th for c, th in tried if c == combo(method["combos"][0])]
        assert min(free) == first[0], method["name"]
        free_pick = bench.curves.pick([p for p in points if p["combo"] == method["combos"][0]], 30.0, 25.0)
        for name in method["combos"]:
            mine = sorted(th for c, th in tried if c == combo(name))
            assert mine[0] == (first[0] if name == method["combos"][0] else free_pick["threshold"]), method["name"]
            ok = [bench.keeps(p) for p in points if p["combo"] == name]
            limits = None if "core" in method else bench.combos("flux")[name]
            assert (len(mine) >= 2 and not all(ok)) or (bench.same_beat(method, limits, mine[-1]) and not any(
                bench.same_beat(method, limits, th) for th in mine[:-1])), method["name"]
        assert picked == bench.curves.pick(points, 30.0, 25.0)


def test_a_placed_beat_runs_each_placement_once_and_picks_as_the_full_walk(bench, monkeypatch):
    """On the placed beat intervals with the same ceil(steps / N) compute the same steps at the same places:
    the walk runs the first of them only (in the grid and past its top) and picks what running all gives."""
    placed = []

    def measure(_bench, setting, steps, runs, refs):
        n, power = setting["threshold"], setting["combo"].get("power", 1.0)
        computed = math.ceil(steps / n)
        if power != 1.0:
            placed.append(n)
        ok = computed >= 3 if power != 1.0 else n <= 6  # placed: the floors hold down to 3 computed steps
        return {"x": steps / computed, "psnr": 40.0 if ok else 20.0, "worst": 35.0 if ok else 15.0, "threshold": n}

    monkeypatch.setattr(bench, "measure", measure)
    rule = next(m for m in bench.methods("flux") if m["name"] == "ReuseKit interval, output forecast")
    rule = dict(rule, combos=rule["combos"][:2])  # the free beat, then the placed one
    points, picked = bench.tune(FakeBench(), rule, 50, TUNING, {})
    once = list(placed)
    assert once == [6.0, 7.0, 8.0, 9.0, 10.0, 13.0, 17.0, 25.0]  # from the free pick; 11, 12, 14-16 place as 10, 13
    placed.clear()
    monkeypatch.setattr(bench, "same_placement", lambda *a: False)
    _, full = bench.tune(FakeBench(), rule, 50, TUNING, {})
    assert len(placed) > len(once) and {math.ceil(50 / n) for n in placed} <= {math.ceil(50 / n) for n in once}
    assert (picked["combo"], picked["threshold"]) == (bench.END_DENSE, 17.0)
    assert (picked["combo"], picked["threshold"], picked["x"]) == (full["combo"], full["threshold"], full["x"])


def test_a_start_dense_beat_walks_every_interval_as_its_span_moves_with_each(bench):
    """A start-dense beat spans the fixed beat's N (k - 1): intervals with the same ceil(steps / N) place
    different steps, so none is left out of its walk (an end-dense beat's are, as they place alike)."""
    tc = rkharness.pack("caching.step_cache")
    start, end = bench.combos("flux")[bench.START_DENSE], bench.combos("flux")[bench.END_DENSE]
    assert math.ceil(50 / 11) == math.ceil(50 / 12)
    assert tc.placed_beat(50, 11, start["power"]) != tc.placed_beat(50, 12, start["power"])
    assert not bench.same_placement(start, 11.0, 12.0, 50)
    assert tc.placed_beat(50, 11, end["power"]) == tc.placed_beat(50, 12, end["power"])
    assert bench.same_placement(end, 11.0, 12.0, 50)


def test_a_sweep_walks_on_past_its_grids_top_while_the_floors_hold(bench, monkeypatch):
    """No method is cut short by its grid: a threshold rule whose quality holds to twice its grid's top, and
    an interval whose holds to 14, are picked there (the first setting past it misses), and a sweep that
    never misses says its pick is the sweep's end."""
    calls = []

    def measure(_bench, setting, steps, runs, refs):
        th = setting["threshold"]
        calls.append((setting["name"], th))
        holds = 14 if setting["grid"] == "interval" else 2 * bench.grid(setting, quick=False)[-1]
        ok = th <= holds * (1 + 1e-9)
        return {"x": 1.0 + th, "psnr": 40.0 if ok else 20.0, "worst": 35.0 if ok else 15.0, "threshold": th}

    monkeypatch.setattr(bench, "measure", measure)
    teacache = next(m for m in bench.methods("flux") if m["name"] == "TeaCache")
    top = bench.grid(teacache, quick=False)[-1]
    points, picked = bench.tune(FakeBench(), dict(teacache, combos=["free"]), 50, TUNING, {})
    assert top < picked["threshold"] <= 2 * top and not picked.get("end")
    assert any(p["threshold"] > picked["threshold"] and not bench.keeps(p) for p in points)
    seer = next(m for m in bench.methods("flux") if m["name"] == "TaylorSeer order 1")
    points, picked = bench.tune(FakeBench(), dict(seer, combos=["free"]), 50, TUNING, {})
    assert bench.INTERVALS[-1] < 14 and picked["threshold"] == 14.0 and max(p["threshold"] for p in points) == 15.0
    points, picked = bench.tune(FakeBench(), dict(seer, combos=["free"]), 12, TUNING, {})  # at most N = 11
    assert picked["threshold"] == 11.0 and picked["end"] and "sweep's end" in bench._setting(picked)


def test_an_intervals_walk_goes_on_past_a_miss_as_its_quality_is_not_monotone_in_n(bench, monkeypatch):
    """Where an interval's last computed step falls matters: N = 5 may miss where N = 8 keeps. Every interval
    of the grid below the step count is tried, so the pick is the fastest that kept the floors, not the
    last before the first miss; a threshold rule's walk still ends at its first miss."""
    tried, kept = [], {2.0, 3.0, 4.0, 8.0}  # an interval that misses at 5 to 7 and keeps at 8

    def measure(_bench, setting, steps, runs, refs):
        th = setting["threshold"]
        tried.append(th)
        ok = th in kept
        return {"x": th, "psnr": 40.0 if ok else 20.0, "worst": 35.0 if ok else 15.0, "threshold": th}

    monkeypatch.setattr(bench, "measure", measure)
    seer = next(m for m in bench.methods("flux") if m["name"] == "TaylorSeer order 1")
    points, picked = bench.tune(FakeBench(), dict(seer, combos=["free"]), 50, TUNING, {})
    assert picked["threshold"] == 8.0 and tried == [float(n) for n in bench.INTERVALS]
    tried.clear()
    points, picked = bench.tune(FakeBench(), dict(seer, combos=["free"]), 7, TUNING, {})
    assert tried == [2.0, 3.0, 4.0, 5.0, 6.0] and picked["threshold"] == 4.0  # N below the step count
    tried.clear()
    teacache = next(m for m in bench.methods("flux") if m["name"] == "TeaCache")
    kept.clear()  # every threshold misses: the walk ends at the grid's first, with nothing to refine
    bench.tune(FakeBench(), dict(teacache, combos=["free"]), 50, TUNING, {})
    assert tried == [bench.grid(teacache, quick=False)[0]]


class SweepBench(FakeBench):
    """A Bench as ``sweep`` and ``default_points`` build one: the calibrations it is asked for recorded, the
    stand-in's magnitude curves and shipped tables stubbed; every run goes through ``measure``."""

    def __init__(self, family, quick, cfg):
        import types

        self.family, self.quick, self.cfg, self.calibrated, self.model = family, quick, cfg, [], None
        self.S = types.SimpleNamespace(calibrated_magnitudes=lambda *a: {}, curve_match=lambda *a: 0.0,
                                       PUBLISHED_STEPS={"flux": 50, "wan": 50})
        self.schedule = types.SimpleNamespace(shipped_table=lambda family: None)
        SweepBench.made.append(self)

    def calibrate(self, steps):
        self.calibrated.append(steps)
        return {}


@pytest.fixture
def swept(bench, monkeypatch):
    """``sweep`` and ``default_points`` on SweepBench: each ``measure`` call recorded as (method, runs), in order;
    quality falls along each method's grid as in ``measured``."""
    calls = []

    def measure(_bench, setting, steps, runs, refs):
        assert set(runs) <= set(refs)  # every run has its uncached reference
        calls.append((setting["name"], tuple(runs)))
        th = setting.get("threshold") or 0.0
        lo, *_, hi = bench.grid(setting, quick=False) if setting.get("grid") else (0.0, 1.0)
        r = min(max((th - lo) / (hi - lo), 0.0), 1.0)
        return {"x": 1.0 + 4 * r, "x_lo": 1.0, "x_hi": 1.0, "deep_x": 1.0, "cpu_x": 1.0, "psnr": 45.0 - 20 * r,
                "worst": 40.0 - 20 * r, "ssim": 1.0, "err": 0.0, "threshold": setting.get("threshold")}

    SweepBench.made = []
    monkeypatch.setattr(bench, "Bench", SweepBench)
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "references", lambda _b, steps, runs: {r: (None, 10.0, 1.0) for r in runs})
    return calls


@pytest.mark.parametrize("setup", ["flux", "flux-cfg1", "wan"])
def test_a_sweep_calibrates_unscored_tunes_on_tuning_runs_and_scores_each_pick_once_on_evaluation(bench, swept,
                                                                                                 setup):
    """The whole sweep of a setup, as the bench runs it: its one calibration at an unscored step count; every
    method's settings measured on the tuning runs only, then its pick once on the evaluation runs, after
    its tuning; the published rows on the evaluation runs alone."""
    tuning = tuple(bench.tuning_runs(quick=False))
    evals = tuple((p, s) for p in bench.EVAL_PROMPTS for s in bench.SEEDS)
    assert not set(tuning) & set(evals) and len(evals) == 32
    for steps in bench.STEP_COUNTS:
        swept.clear()
        out = bench.sweep(setup, steps, quick=False)
        (made,) = SweepBench.made[-1:]
        assert made.calibrated == [bench.calibration_steps(steps)] and steps not in made.calibrated
        rows = out["steps"][steps]["rows"]
        for row in rows:
            mine = [runs for name, runs in swept if name == row["name"]]
            if row["kind"] == "information":  # published: scored as published, never tuned
                assert mine == [evals], row["name"]
                continue
            scored = [i for i, runs in enumerate(mine) if runs == evals]
            assert all(runs in (tuning, evals) for runs in mine), row["name"]
            assert scored == ([len(mine) - 1] if row["picked"] is not None else []), row["name"]
            assert row["picked"] is None or row["picked"]["threshold"] is None or row["picked"] in row["tune"]


def test_the_default_candidates_are_walked_on_the_tuning_runs_alone(bench, swept):
    tuning = tuple(bench.tuning_runs(quick=False))
    bench.default_points("flux", 28)
    assert swept and all(runs == tuning for _, runs in swept)
    assert {name for name, _ in swept} == {f"{rule} {mode}" for rule, mode in bench.DEFAULT_CANDIDATES}


def test_every_ranked_method_gets_the_same_search_over_skip_limits_and_windows(bench):
    """Every threshold rule sweeps every combo (skip limits, windows, the last step); the placed beats are
    the interval rule's alone (ReuseKit's: a placement TaylorSeer and FoCa do not define); both core nodes
    get the same two windows."""
    for family in bench.FAMILIES:
        every = [c for c in bench.combos(family) if c not in bench.PLACED]
        for m in bench.methods(family):
            if m.get("defaults"):
                continue
            if "core" in m:
                assert m["combos"] == ["0-1", ".15-.95"], m["name"]
                continue
            assert [c for c in m["combos"] if c not in bench.PLACED] == every, m["name"]
            placed = [c for c in m["combos"] if c in bench.PLACED]
            assert placed == ([*bench.PLACED] if m["name"] == "ReuseKit interval, output forecast" else []), m["name"]


def test_each_core_node_samples_with_its_copy_of_the_input_outermost(bench, tiny):
    """EasyCache and LazyCache add their cached residual into their input in place: the bench's wrapper,
    outside theirs, gives them a copy, so a skip never changes the sampler's latent."""
    import types

    import comfy.patcher_extension

    host = types.SimpleNamespace(model=tiny.tiny_flux(0))
    for m in [m for m in bench.methods("flux") if "core" in m]:
        built = bench.Bench.build(host, dict(m, combo=m["combos"][0], threshold=0.1), 20)
        wrappers = built.wrappers[comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL]
        assert list(wrappers)[0] == "rk_bench_clone_input" and wrappers["rk_bench_clone_input"] == [bench.clone_input]


def test_a_reference_row_runs_with_the_signed_polynomial_and_every_other_with_reusekits(bench):
    """``measure`` itself puts the TeaCache reference's signed accumulation in place around its runs (and
    only theirs): the rescale each run of a row sees."""
    tc = rkharness.pack("caching.step_cache")

    class Recording(FakeBench):
        def __init__(self):
            self.tc, self.seen = tc, []

        def build(self, setting, steps):
            return None

        def store_for(self, setting, steps):
            return None

        def run(self, model, prompt, seed, steps, store, deep_first=1):
            self.seen.append(self.tc.rescale)
            return torch.zeros(1), 10.0, 10.0, 1.0

        def metrics(self, out, ref):
            return 40.0, 1.0, 0.0

    refs = {r: (None, 10.0, 1.0) for r in TUNING}
    own = tc.rescale
    for m in [m for m in bench.methods("flux") if m.get("rule") == "teacache"] + \
            [r for r in bench.published_rows("flux") if r["rule"] == "teacache"]:
        rec = Recording()
        bench.measure(rec, dict(m, combo=bench.combos("flux")["free"], threshold=0.1), 28, TUNING, refs)
        assert rec.seen == [tc.polynomial if m.get("signed") else own] * len(TUNING), m["name"]
    assert tc.rescale is own
    assert {m["name"] for m in bench.methods("flux") if m.get("signed")} == {"TeaCache"}


def test_a_walk_past_a_grids_top_stops_at_the_nodes_threshold_range(bench):
    """Every setting the bench tries is one a user can set: the walk past a grid's top ends at the node's
    threshold range (a setting past it is refused, naming the input)."""
    top = rkharness.pack("nodes.step_cache").THRESHOLD_MAX
    for m in [m for m in bench.methods("flux") if m.get("grid") not in (None, "interval", "core")]:
        assert bench.beyond(m, top * 0.9, 50, quick=False) is None, m["name"]
        assert bench.grid(m, quick=False)[-1] < bench.beyond(m, bench.grid(m, quick=False)[-1], 50, quick=False) <= top


def test_calibration_step_counts_are_never_scored(bench):
    assert not set(bench.CALIBRATION_STEPS) & set(bench.STEP_COUNTS)
    assert {bench.calibration_steps(s) for s in bench.STEP_COUNTS} <= set(bench.CALIBRATION_STEPS)
    assert set(bench.RESULT_STEPS) <= set(bench.STEP_COUNTS)
    assert not {p for p, _ in [bench.CALIBRATION]} & set(bench.TUNING_PROMPTS + bench.EVAL_PROMPTS)
    assert not set(bench.TUNING_PROMPTS) & set(bench.EVAL_PROMPTS)


def test_the_tuning_runs_are_every_tuning_prompt_at_several_seeds_none_an_evaluation_seed(bench):
    runs = bench.tuning_runs(quick=False)
    assert len(bench.TUNING_SEEDS) >= 2 and not set(bench.TUNING_SEEDS) & set(bench.SEEDS)
    assert sorted(runs) == sorted((p, s) for p in bench.TUNING_PROMPTS for s in bench.TUNING_SEEDS)
    assert len(set(runs)) == len(runs)
    assert set(bench.tuning_runs(quick=True)) < set(runs)


def test_a_defaults_thresholds_by_step_count_keep_the_floors_at_every_setup(bench):
    def unit(setup, steps, points):
        return {"setup": setup, "family": bench.SETUPS[setup][0], "steps": steps, "points": points}

    def walk(*xs_worst):  # thresholds 0.1, 0.2, ...: (speedup, worst dB)
        return [pt(x, 40.0, w, threshold=round(0.1 * (i + 1), 1)) for i, (x, w) in enumerate(xs_worst)]

    units = [unit("flux", 28, {"a": walk((2, 35), (3, 30), (4, 20)), "b": walk((2.5, 33), (5, 26))}),
             unit("flux-cfg1", 28, {"a": walk((2, 35), (3.5, 29), (4.5, 28)), "b": walk((3, 30), (6, 29))}),
             unit("flux", 50, {"a": walk((3, 35), (4, 33), (5, 30)), "b": walk((4, 30), (6, 20))}),
             unit("flux-cfg1", 50, {"a": walk((3, 35), (4, 33), (6, 30)), "b": walk((4, 30), (4, 29))}),
             unit("wan", 28, {"a": walk((3, 30), (4, 28)), "b": walk((2, 30), (3, 20))}),
             unit("wan", 50, {"a": walk((4, 30), (5, 20)), "b": walk((5, 30))})]
    got = bench.pick_defaults(units)
    flux = {r["candidate"]: r for r in got["flux"]["ranked"]}
    # a: 0.3 misses at flux 28 (20 dB): 0.2 there (slowest 3x); at 50 every setup keeps 0.3 (slowest 5x)
    assert flux["a"]["anchors"] == [(28, 0.2), (50, 0.3)] and flux["a"]["x"] == {28: 3, 50: 5}
    # b: 0.2 misses at flux 28 (26 < 27 dB): 0.1 (2.5x); at 50 flux misses 0.2 too: 0.1 (4x)
    assert flux["b"]["anchors"] == [(28, 0.1), (50, 0.1)] and flux["b"]["x"] == {28: 2.5, 50: 4}
    assert got["flux"]["default"]["candidate"] == "a" and flux["b"]["worth"] == pytest.approx(min(2.5 / 3, 4 / 5))
    # wan a keeps 0.2 at 28 but only 0.1 at 50: more steps never get a lower threshold, so 0.1 at both
    wan = {r["candidate"]: r for r in got["wan"]["ranked"]}
    assert wan["a"]["anchors"] == [(28, 0.1), (50, 0.1)] and wan["a"]["x"] == {28: 3, 50: 4}
    assert wan["b"]["anchors"] == [(28, 0.1), (50, 0.1)] and got["wan"]["default"]["candidate"] == "a"


def test_the_workers_take_the_costliest_units_first_and_merge_per_setup(bench):
    work = bench.units((20, 50))
    assert work[0] == ("flux", 50) and work[-1] == ("flux-cfg1", 20) and len(work) == 6
    parts = [{"setup": "wan", "steps": {n: {"rows": []}}, "calibrated_at": {n: 24}, "seconds": 1.0, "cpu_seconds": 2.0,
              "curve_match": 0.1} for n in (20, 28)]
    merged = bench.merge(parts)
    assert set(merged) == {"wan"} and set(merged["wan"]["steps"]) == {20, 28} and merged["wan"]["cpu_seconds"] == 4.0


# ---- methods -----------------------------------------------------------------------------------------

def test_the_field_holds_the_published_methods_as_their_papers_define_them(bench):
    rows = {m["name"]: m for m in bench.methods("flux")}
    baselines = [m for m in rows.values() if m["kind"] == "baseline"]
    assert len(baselines) >= 8
    assert rows["TeaCache"]["signed"] and rows["TeaCache"]["mode"] == "reuse"
    # FORA reuses what its last full step's blocks added; TaylorSeer and FoCa forecast it
    assert {m["mode"]: m["name"] for m in baselines if m.get("rule") == "interval"} == {
        "reuse": "FORA", "taylorseer1": "TaylorSeer order 1", "taylorseer2": "TaylorSeer order 2", "foca": "FoCa"}
    # the papers' fixed beat for the baselines; the placed one is ReuseKit's interval rule's own setting
    for placed in bench.PLACED:
        assert [m["name"] for m in rows.values() if placed in m.get("combos", ())] == [
            "ReuseKit interval, output forecast"]
    assert bench.combos("flux")[bench.END_DENSE]["power"] > 1 > bench.combos("flux")[bench.START_DENSE]["power"]
    assert all(m["mode"] == "reuse" for m in baselines if m.get("rule") in ("teacache", "magcache", "first_block"))
    # DBCache at cache-dit's default F8B0: the same share of each stand-in's blocks decides, priced as 8 blocks
    for family, blocks in (("flux", 12), ("wan", 10)):
        db = next(m for m in bench.methods(family) if m["name"] == "DBCache (F8B0)")
        assert (db["kind"], db["rule"], db["deep_first"]) == ("baseline", "first_block", 8)
        assert db["first_blocks"] == round(8 / bench.DEEP_BLOCKS[family] * blocks), family
    # constants fitted on the real models are never ranked
    assert all(m["model_type"] in ("calibrated", "auto") for m in baselines if "rule" in m)
    assert all(r["kind"] == "information" for r in bench.published_rows("flux"))
    assert any(r["rule"] == "schedule" and r["model_type"] == "auto" for r in bench.published_rows("flux"))
    for family, (threshold, start) in (("flux", (0.4, 0.0)), ("wan", (0.15, 0.1))):  # each polynomial's own setting
        tea = next(r for r in bench.published_rows(family) if r["rule"] == "teacache")
        assert (tea["model_type"], tea["threshold"], tea["combo"]) == (
            bench.PUBLISHED[family], threshold, dict(K=3, start=start, last=True)), family
    assert bench.PUBLISHED["wan"].endswith("_ret_mode")  # ret mode: 0.15 from 10%, not the other polynomial's 0.08
    assert not any(m.get("model_type") not in (None, "calibrated") and m.get("rule") == "schedule"
                   for m in rows.values())  # the shipped table is never ranked


def test_the_teacache_reference_accumulates_the_signed_polynomial(bench):
    tc = rkharness.pack("caching.step_cache")
    coefficients, x = (1.0, -2.0), torch.tensor(0.25)  # poly(x) = x - 2 < 0
    assert float(tc.rescale(coefficients, x)) == pytest.approx(1.75)
    with bench.as_published(tc, {"signed": True}):
        assert float(tc.rescale(coefficients, x)) == pytest.approx(-1.75)
    assert float(tc.rescale(coefficients, x)) == pytest.approx(1.75)


def test_a_calibrated_schedule_row_reads_its_own_calibration_and_no_shipped_sensitivity(bench, monkeypatch):
    """The node lends a calibrated schedule table the shipped table's sensitivity (measured with 38 single-skip runs
    on the tuning prompts, a budget no other calibrated method gets); the bench's calibrated row runs on its own
    calibration alone, and lands elsewhere for it. The shipped table is back after the run (the information row
    reads it)."""
    import nodes

    stand_in = bench.Bench("flux", quick=True)
    stand_in.calibrate(24)
    lent = []
    real = stand_in.schedule.ResidualTable.with_sensitivity_of
    monkeypatch.setattr(stand_in.schedule.ResidualTable, "with_sensitivity_of",
                        lambda table, other: lent.append(other) or real(table, other))
    setting = dict(rule="schedule", model_type="calibrated", mode="extrapolate", threshold=0.02,
                   combo=bench.combos("flux")["free"])
    store = stand_in.store_for(setting, 28)
    model, prompt = stand_in.build(setting, 28), bench.TUNING_PROMPTS[0]
    out, *_ = stand_in.run(model, prompt, 7, 28, store)
    assert lent == [None] and stand_in.schedule.shipped_table("flux") is not None
    stand_in.P.STORE = store  # the node as a user runs it: the same calibration, the shipped sensitivity lent
    (node_out,) = nodes.common_ksampler(model, 7, 28, stand_in.cfg, "euler", "simple", stand_in.cond(prompt),
                                        stand_in.cond(""), {"samples": stand_in.S.empty_latent("flux")})
    assert lent[1] is stand_in.schedule.shipped_table("flux")
    assert not torch.equal(out, node_out["samples"])


def test_easycache_gets_a_copy_of_its_input_it_may_change_in_place(bench):
    x = torch.ones(2, 3)

    def model(got, *args, **kwargs):
        got += 1.0  # what EasyCache does on a skipped step
        return got

    out = bench.clone_input(model, x, "t")
    assert torch.equal(x, torch.ones(2, 3)) and torch.equal(out, torch.full((2, 3), 2.0))


# ---- the result --------------------------------------------------------------------------------------

def row(name, kind, x, psnr, worst=None):
    return {"name": name, "kind": kind, "tune": [], "picked": {"combo": "free", "threshold": 0.1},
            "eval": pt(x, psnr, worst, x_lo=x, x_hi=x, combo="free")}


def results(defaults, ours, base, info=(9.0, 20.0)):
    """Three setups at 20 (not counted), 28 and 50 steps: defaults, one ReuseKit rule, a baseline, information."""
    def steps(d, o, b):
        return {"rows": [row("ReuseKit node defaults", "reusekit", *d), row("ReuseKit schedule, reuse", "reusekit", *o),
                         row("TeaCache", "baseline", *b), row("MagCache published", "information", *info)]}

    def setup(d, o, b):
        return {"curve_match": 0.02, "seconds": 1.0,
                "steps": {"20": steps((1.5, 35.0), (9.0, 35.0), (1.5, 31.0)), "28": steps(d, o, b), "50": steps(d, o, b)}}

    return {"flux": setup(defaults[0], ours[0], base[0]),
            "flux-cfg1": setup(defaults[1], ours[1], base[1]), "wan": setup(defaults[2], ours[2], base[2])}


def test_the_result_is_the_minimum_over_the_setups_at_28_and_50_steps(bench):
    class Args:
        quick = False
        methods = None

    text = bench.report(results(defaults=[(3.0, 40.0, 38.0), (2.6, 36.0, 26.0), (3.5, 40.0)],
                                ours=[(4.0, 35.0), (3.9, 31.0), (6.0, 29.0)],  # wan's own pick misses the floors
                                base=[(2.5, 31.0), (2.0, 32.0), (3.0, 33.0)]), Args())
    last = text.splitlines()[-1]
    assert last.startswith("RESULT ")
    got = {k: float(v) for k, v in (kv.split("=") for kv in last.split()[1:])}
    assert got["default_speedup_min"] == pytest.approx(2.6)  # flux at CFG 1
    assert got["default_worst_psnr_min"] == pytest.approx(26.0)
    assert got["default_vs_best_baseline_min"] == pytest.approx(1.17, abs=0.01)  # wan: 3.5 / 3.0
    assert got["vs_best_baseline_min"] == pytest.approx(1.6)  # flux: 4.0 / 2.5; both sides alike, whatever quality
    assert "keeping the floors on evaluation: best baseline 3.00x (TeaCache" in text  # wan: its rule missed them
    assert "best ReuseKit rule none" in text
    assert got["baselines"] == 1
    assert "information" in text and "9.00x" in text  # shown, never ranked


def test_baselines_count_each_method_once_whatever_its_rows(bench):
    """TaylorSeer's two orders are one method, and First-Block and cache-dit's DBCache (the first_block rule deciding
    after more blocks) another: the field's count is its methods', not its rows'."""
    names = [m["name"] for m in bench.methods("flux") if m["kind"] == "baseline"]
    rows = [dict(row(name, "baseline", 2.0, 31.0), name=name) for name in names]
    (summary,) = bench.summarize({"flux": {"steps": {"28": {"rows": rows}}}}).values()
    assert len(names) == 10 and summary["baselines"] == 8


def test_some_rows_alone_print_their_table_and_no_result_line(bench):
    """--methods: the rows named, each tuned and scored by the protocol; no RESULT line (it reads the field),
    and a name the bench has no row of is refused naming the rows."""
    assert [m["name"] for m in bench.chosen("flux", ["FoCa", "ReuseKit adaptive, output forecast"])] == [
        "FoCa", "ReuseKit adaptive, output forecast"]
    assert bench.chosen("wan", None) == bench.methods("wan")
    with pytest.raises(SystemExit, match="no row named 'Foca'; the rows: 'TeaCache'"):
        bench.chosen("flux", ["Foca"])

    class Args:
        quick = False
        methods = ["TeaCache"]

    every = results(defaults=[(3.0, 40.0, 38.0)] * 3, ours=[(4.0, 35.0)] * 3, base=[(2.5, 31.0)] * 3)
    for res in every.values():
        for data in res["steps"].values():
            data["rows"] = [r for r in data["rows"] if r["name"] == "TeaCache"]
    text = bench.report(every, Args())
    assert not any(line.startswith("RESULT") for line in text.splitlines()) and text.splitlines()[-1] == "no RESULT line: 1 of the field's rows ran (--methods)"
    assert "best ReuseKit rule none; node defaults not run" in text and "2.50x" in text


def test_the_report_names_the_evaluation_run_most_often_a_rows_worst(bench):
    def row(name, runs):
        return {"name": name, "eval": {"runs": runs}}

    fragile = ("a blue triangle", 3)
    rows = [row("a", [["a red circle", 1, 40.0], [*fragile, 21.0]]),
            row("b", [["a red circle", 1, 30.0], [*fragile, 31.0]]),
            row("c", [["a red circle", 1, 44.0], [*fragile, 20.5]]),
            row("uncached", None)]  # computed every step: no runs
    assert bench.worst_runs(rows) == [(fragile, 2), (("a red circle", 1), 1)]


@pytest.fixture(scope="module")
def plans(bench):
    spec = importlib.util.spec_from_file_location("reusekit_bench_step_cache_plans", BENCH / "step_cache_plans.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_findings_plans_are_taylorseers_beat_and_its_variants(plans):
    got = plans.findings(50)
    assert all(len(p) == 50 and set(p) <= set("CSH") for p in got)
    assert got[0] == "".join("C" if i % 9 == 0 else "S" for i in range(50))  # TaylorSeer's N = 9
    assert [p.count("C") for p in got[:5]] == [6, 5, 14, 7, 7]
    assert got[5].count("C") == 3 and got[5].count("H") == 3  # every other computed step an H step


def test_the_plans_validation_runs_are_neither_tuning_nor_evaluation_runs(bench, plans):
    held_out = plans.validation_runs()
    assert len(held_out) == len(set(held_out)) == 16
    assert not set(held_out) & set(bench.tuning_runs(False))
    assert not {p for p, _ in held_out} & set(bench.EVAL_PROMPTS)
    assert not {s for _, s in held_out} & (set(bench.SEEDS) | set(bench.TUNING_SEEDS) | {bench.CALIBRATION[1]})


def test_a_forced_plan_computes_what_it_says_and_all_c_is_the_uncached_picture(bench, plans):
    with torch.inference_mode():
        stand_in = bench.Bench("flux", False, 3.5)
        runs = [(bench.TUNING_PROMPTS[0], bench.TUNING_SEEDS[0])]
        refs = bench.references(stand_in, 6, runs)
        scored = {plan: plans.score_plan(stand_in, plan, "taylorseer1", runs, refs)
                  for plan in ("CCCCCC", "CSCSCC", "CHCHCC")}
    assert scored["CCCCCC"]["x"] == 1.0 and scored["CCCCCC"]["psnr"] == bench.curves.PSNR_CAP
    assert scored["CSCSCC"]["x"] == pytest.approx(6 / 4) and scored["CSCSCC"]["psnr"] < bench.curves.PSNR_CAP
    assert scored["CHCHCC"]["x"] == pytest.approx(6 / 5)  # an H step computes the cond branch alone: half a step
    assert scored["CHCHCC"]["psnr"] < bench.curves.PSNR_CAP


def test_an_output_plan_is_the_interval_rules_beat_forced_and_all_c_is_the_uncached_picture(bench, plans):
    with torch.inference_mode():
        stand_in = bench.Bench("flux", False, 3.5)
        placement = stand_in.tc.placed_beat
        runs = [(bench.TUNING_PROMPTS[0], bench.TUNING_SEEDS[0])]
        refs = bench.references(stand_in, 6, runs)
        scored = {plan: plans.score_plan(stand_in, plan, "output", runs, refs) for plan in ("CCCCCC", "CSCSCS")}
        every_other = dict(rule="interval", model_type="auto", mode="output", threshold=2.0,
                           combo=dict(K=0, start=0.0, last=False))
        rule = bench.measure(stand_in, every_other, 6, runs, refs)  # the rule's own fixed beat of 2
    assert scored["CCCCCC"]["x"] == 1.0 and scored["CCCCCC"]["psnr"] == bench.curves.PSNR_CAP
    assert scored["CSCSCS"]["x"] == pytest.approx(2.0) and scored["CSCSCS"]["psnr"] < bench.curves.PSNR_CAP
    assert scored["CSCSCS"]["psnr"] == rule["psnr"] and scored["CSCSCS"]["err"] == rule["err"]
    assert stand_in.tc.placed_beat is placement  # the real placement is back


def test_an_interval_under_a_skip_limit_stops_at_the_limits_beat_and_picks_as_the_longer_walk(bench, monkeypatch):
    """Under max_consecutive_skips K every interval above K runs one beat (a computed call, K skipped), so
    a restricted combo's walk ends at the first of them: its pick is the one the walk on to the steps gave
    (ties keep the smaller interval), and it is not called the sweep's end."""
    def measure(_bench, setting, steps, runs, refs):
        n = setting["threshold"]
        beat = min(n, setting["combo"]["K"] + 1) if setting["combo"]["K"] else n
        return {"x": beat, "psnr": 45.0 - beat, "worst": 40.0 - beat, "threshold": n}

    monkeypatch.setattr(bench, "measure", measure)
    seer = next(m for m in bench.methods("flux") if m["name"] == "TaylorSeer order 1")
    points, picked = bench.tune(FakeBench(), seer, 50, TUNING, {})
    free = [p["threshold"] for p in points if p["combo"] == "free"]
    capped = [p["threshold"] for p in points if p["combo"] == "teacache K3 last"]
    assert max(free) == 16.0 and capped == [15.0]  # free keeps the floors to 15; K3: 15 runs the beat 4
    assert picked["threshold"] == 15.0 and picked["combo"] == "free" and not picked.get("end")
    monkeypatch.setattr(bench, "same_beat", lambda *a: False)  # the long walk: every capped interval measured
    long_points, long_pick = bench.tune(FakeBench(), seer, 50, TUNING, {})
    assert len(long_points) > len(points) and long_pick == picked

    def capped_pick(pts):
        return bench.curves.pick([p for p in pts if p["combo"] == "teacache K3 last"], 30.0, 25.0)

    assert capped_pick(long_points) == capped_pick(points)  # the restricted combo's own pick did not move


def test_the_dbcache_row_builds_the_node_with_its_first_blocks(bench):
    """The row's setting reaches the node: the model it samples with decides after its first blocks."""
    import types

    model = importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux").build()
    db = next(m for m in bench.methods("flux") if m["name"] == "DBCache (F8B0)")
    host = types.SimpleNamespace(N=rkharness.pack("nodes.step_cache"), model=model)
    built = bench.Bench.build(host, dict(db, combo=bench.combos("flux")["free"], threshold=0.1), 20)
    settings = built.model_options["transformer_options"][rkharness.pack("patches.step_cache").KEY]
    assert (settings.config.rule, settings.config.first_blocks) == ("first_block", 2)
