"""The step cache's schedule rule: the planner on known residuals (its errors against an independent
computation, its table lookup for step counts the table was not measured at, H steps, limits), and the
rule on the trained Flux through the real KSampler (a plan followed, cond-only steps that run the
cond's rows alone, a calibration's table)."""

import dataclasses
import importlib
import math

import pytest
import rkharness
import torch

pytestmark = pytest.mark.step_cache


def S():
    return rkharness.pack("caching.step_schedule")


def tc():
    return rkharness.pack("caching.step_cache")


def P():
    return rkharness.pack("patches.step_cache")


def N():
    return rkharness.pack("nodes.step_cache")


@pytest.fixture(autouse=True)
def _isolated_calibrations(monkeypatch, tmp_path):
    """Calibrations in a temporary file; no shipped table (a test that wants one patches it in)."""
    store = tc().CalibrationStore(tmp_path / "teacache_calibration.json")
    monkeypatch.setattr(P(), "STORE", store)
    monkeypatch.setattr(S(), "shipped_table", lambda family: None)
    return store


def flow_sigmas(steps: int, shift: float = 3.0) -> list[float]:
    """A flow schedule's sigmas (shifted, as Flux and Wan use), the final 0 included."""
    return [shift * t / (1 + (shift - 1) * t) for t in (1 - i / steps for i in range(steps))] + [0.0]


def residual_fn(seed: int, curved: bool = True, offset: float = 0.0):
    """Residuals as a smooth function of sigma per branch: (cond(sigma), uncond(sigma)) of 64 values;
    ``curved`` False: linear in sigma; the uncond is the cond minus a fixed difference plus ``offset``
    times one that changes with sigma (linearly where not ``curved``)."""
    g = torch.Generator().manual_seed(seed)
    a, b, c, d, e = (torch.randn(64, generator=g, dtype=torch.float64) for _ in range(5))

    def cond(s):
        return a + b * s + (c * math.sin(3 * s) if curved else 0.0)

    def uncond(s):
        return cond(s) - d + offset * e * (s * s if curved else s)

    return cond, uncond


def table_of(fns, sigmas: list[float]):
    """The table of residuals ``fns`` measured at ``sigmas`` (the run's steps), unit gains."""
    per = {"cond": [fns[0](s).float() for s in sigmas], "uncond": [fns[1](s).float() for s in sigmas]}
    return S().ResidualTable.from_samples([(sigmas, per, [1.0] * len(sigmas), 1.0)])


def true_errors(plan, fns, table, sigmas: list[float], cfg: float, mode: str) -> list[float]:
    """The error of every step of ``plan`` computed from the residual vectors themselves (read between the
    table's sigmas the way the table reads them): what the planner must have bounded. Mirrors the run:
    C stores both branches, H the cond and cond minus the difference of the last C, S adds forecasts."""
    grid = table.sigmas
    scale = math.sqrt(sum(float(fns[b](s).float().double().pow(2).sum()) for s in grid for b in (0, 1)) / (2 * len(grid)))

    def at(b, s):  # linear between the table's sigmas, the nearest end beyond
        if s >= grid[0]:
            return fns[b](grid[0]).float().double()
        if s <= grid[-1]:
            return fns[b](grid[-1]).float().double()
        i = next(i for i in range(len(grid) - 1) if grid[i] >= s >= grid[i + 1])
        w = (grid[i] - s) / (grid[i] - grid[i + 1])
        return fns[b](grid[i]).float().double() * (1 - w) + fns[b](grid[i + 1]).float().double() * w

    hist, delta, drift, out = [[], []], None, None, []
    for k, action in enumerate(plan.actions):
        s = sigmas[k]
        truth = [at(0, s), at(1, s)]
        width = abs(sigmas[k] - sigmas[k + 1]) * table.on(sigmas[:-1])[1][k]
        guided = truth[0] * cfg + truth[1] * (1 - cfg)
        if action == "C":
            hist = [(h + [(s, t)])[-2:] for h, t in zip(hist, truth, strict=True)]
            delta, drift = truth[0] - truth[1], None
            out.append(0.0)
            continue
        est = ([truth[0], truth[0] - delta] if action == "H" else
               [S().forecast(h, s, mode) for h in hist])
        err = (est[0] * cfg + est[1] * (1 - cfg) - guided) * width / scale
        drift = err if drift is None else drift + err
        out.append(float(drift.norm()))
        if action == "H":
            hist = [(h + [(s, t)])[-2:] for h, t in zip(hist, est, strict=True)]
            drift = None
    return out


# ---- the planner ---------------------------------------------------------------------------------

def test_a_table_round_trips_and_anything_malformed_is_a_miss():
    table = table_of(residual_fn(0), flow_sigmas(6)[:-1])
    again = S().ResidualTable.from_json(table.to_json())
    assert again.sigmas == table.sigmas and again.gains == table.gains
    assert torch.allclose(torch.tensor(again.gram), torch.tensor(table.gram), rtol=1e-6)
    good = table.to_json()
    for broken in ({**good, "sigmas": good["sigmas"][::-1]}, {**good, "branches": ["uncond"]},
                   {**good, "gram": good["gram"][:-1]}, {**good, "gains": [-1.0] * len(good["gains"])},
                   {**good, "gram": [[float("nan")] * len(good["gram"])] * len(good["gram"])},
                   {**good, "sensitivity": [1.0]}, [], None):
        assert S().ResidualTable.from_json(broken) is None


@pytest.mark.hardening
def test_a_table_of_values_whose_products_overflow_plans_no_skip():
    """A damaged calibration file's table of huge finite values (1e300) passes the read, and its error sums
    overflowed to NaN, which the planner read as no error: nearly every step skipped. Such a step is never
    taken for safe."""
    table = table_of(residual_fn(1), flow_sigmas(10)[:-1]).to_json()
    plain = S().plan(S().ResidualTable.from_json(table), flow_sigmas(10), 0.05, 3.5, True)
    assert "S" in plain.actions
    for huge in ({**table, "gains": [1e300] * len(table["gains"])},
                 {**table, "gram": [[v * 1e300 for v in row] for row in table["gram"]]}):
        plan = S().plan(S().ResidualTable.from_json(huge), flow_sigmas(10), 0.05, 3.5, True)
        assert "S" not in plan.actions, plan.actions  # (a cond-only step whose error is exactly 0 stays)


def test_threshold_zero_computes_every_step():
    table = table_of(residual_fn(1), flow_sigmas(10)[:-1])
    assert S().plan(table, flow_sigmas(7), 0.0, 3.5, True).actions == ("C",) * 7


@pytest.mark.parametrize("mode", ["reuse", "extrapolate"])
@pytest.mark.parametrize("steps", [23, 37])  # the table is measured at 50
def test_every_stretch_of_a_plan_for_an_unseen_step_count_stays_within_the_threshold(mode, steps):
    """The table measured at 50 steps plans runs of 23 and 37: the planner's error of every step equals
    the error computed from the residual vectors themselves, no stretch exceeds the threshold, and a
    higher threshold never costs more."""
    fns = residual_fn(2, offset=0.3)
    table = table_of(fns, flow_sigmas(50)[:-1])
    sigmas = flow_sigmas(steps)
    costs = []
    for threshold in (0.002, 0.005, 0.01, 0.03, 0.1):
        plan = S().plan(table, sigmas, threshold, 3.5, True, mode)
        assert plan.actions[0] == "C" and len(plan.actions) == steps
        want = true_errors(plan, fns, table, sigmas, 3.5, mode)
        assert plan.errors == pytest.approx(want, rel=1e-4, abs=1e-9)
        assert max(want) <= threshold * (1 + 1e-6)
        costs.append(sum({"C": 1.0, "H": 0.5, "S": 0.0}[a] for a in plan.actions))
    assert costs == sorted(costs, reverse=True) and costs[-1] < costs[0]


def test_linear_residuals_extrapolate_exactly_within_a_gap_so_every_other_step_skips():
    """Residuals linear in sigma: from two computed steps an extrapolation is exact as far as their gap
    (it never reaches further), so on a schedule whose steps grow the plan computes every other step from
    the third on, while reusing errs too much to skip any."""
    fns = residual_fn(3, curved=False, offset=0.5)
    table = table_of(fns, flow_sigmas(50)[:-1])
    plan = S().plan(table, flow_sigmas(20), 1e-3, 3.5, True, "extrapolate")
    assert "".join(plan.actions) == "CC" + "SC" * 9
    assert max(plan.errors) < 1e-3
    assert S().plan(table, flow_sigmas(20), 1e-3, 3.5, True, "reuse").actions.count("S") == 0


def test_when_the_cond_uncond_difference_holds_still_cond_only_steps_cost_half():
    """uncond = cond - a fixed difference: rebuilding the uncond is exact, so where a skip errs too much
    the plan computes the cond alone (H), at half a step; with one branch (CFG 1) there is no H."""
    fns = residual_fn(4, offset=0.0)
    table = table_of(fns, flow_sigmas(50)[:-1])
    sigmas = flow_sigmas(16)
    plan = S().plan(table, sigmas, 1e-4, 3.5, True)
    assert plan.actions == ("C",) + ("H",) * 15
    assert max(plan.errors) < 1e-4
    assert "H" not in S().plan(table, sigmas, 1e-4, 1.0, False).actions
    cond_only = dataclasses.replace(table, branches=("cond",), gram=tuple(
        tuple(row[0::2]) for row in table.gram[0::2]))
    assert "H" not in S().plan(cond_only, sigmas, 0.05, 3.5, True).actions


def test_the_skip_limit_and_the_window_are_kept():
    fns = residual_fn(5, offset=0.2)
    table = table_of(fns, flow_sigmas(30)[:-1])
    sigmas = flow_sigmas(30)
    allowed = [i < 24 for i in range(30)]
    for k in (1, 2, 3):
        actions = "".join(S().plan(table, sigmas, 10.0, 3.5, True, "reuse", k, allowed).actions)
        assert max(len(run) for run in actions.replace("C", " ").split()) == k
        assert actions[24:] == "C" * 6
    assert "".join(S().plan(table, sigmas, 10.0, 3.5, True).actions).count("C") <= 3  # unlimited: long stretches


def test_the_planners_forecast_is_the_runs():
    """forecast() (the planner's) and RunState.residual (the run's) give the same extrapolation, including
    the clamp at one gap, so a plan bounds what the run adds."""
    run = tc().RunState(tc().StepCacheConfig(None, "auto", 1.0, residual_mode="extrapolate"), None, 1.0, 0.0)
    g = torch.Generator().manual_seed(6)
    r0, r1 = torch.randn(8, generator=g), torch.randn(8, generator=g)
    run.cond("c", "cond")
    run.store_residual("c", r0, 0.9)
    run.store_residual("c", r1, 0.8)
    for sigma in (0.75, 0.7, 0.5):
        want = S().forecast([(0.9, r0), (0.8, r1)], sigma, "extrapolate")
        assert torch.allclose(run.residual("c", r1, sigma), want, atol=1e-6)


# ---- the rule on a real model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux():
    return importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux").build()


def sample(model, conds, steps=10, cfg=3.0, sampler="euler"):
    import nodes

    pos, neg = conds
    (out,) = nodes.common_ksampler(model, 3, steps, cfg, sampler, "simple", pos, neg,
                                   {"samples": torch.zeros(1, 16, 8, 8)})
    return out["samples"]


def scheduled(model, threshold, mode="reuse", model_type="calibrated", max_skips=0):
    (m,) = N().TeaCacheNode.execute(model=model, rule="schedule", threshold=threshold, model_type=model_type,
                                    start_percent=0.0, end_percent=1.0, max_consecutive_skips=max_skips,
                                    cache_device="device", residual_mode=mode).args
    return m


def last_run():
    return P().stats().snapshot()["info"]["last_run"]


def calibrated(flux, conds, steps=10):
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    sample(cal, conds, steps)
    return last_run()


def test_a_calibration_keeps_the_residual_table_with_a_gain_per_step(flux, conds, _isolated_calibrations):
    run = calibrated(flux, conds)
    assert run["outcome"] == "completed"
    key, ident = P().model_identity(flux, P().detect_family(flux))
    table = _isolated_calibrations.get(key, ident).table
    assert len(table.sigmas) == 10 and table.branches == ("cond", "uncond") and len(table.gains) == 10
    assert all(g > 0 for g in table.gains) and table.sensitivity is None
    again = tc().CalibrationStore(_isolated_calibrations.path).get(key, ident).table  # from the file
    assert again.sigmas == table.sigmas


def test_the_rule_follows_its_plan_exactly_at_threshold_zero_and_skips_above_it(flux, conds):
    calibrated(flux, conds)
    ref = sample(flux, conds)
    assert torch.equal(sample(scheduled(flux, 0.0), conds), ref)
    assert last_run()["calls_skipped"] == 0
    for mode in ("reuse", "extrapolate"):
        out = sample(scheduled(flux, 0.01, mode), conds)
        run = last_run()
        assert run["rule"] == "schedule" and run["model_type"] == "calibrated"
        cond, uncond = run["conds"]["cond"]["pattern"], run["conds"]["uncond"]["pattern"]
        assert "S" in cond and cond[0] == uncond[0] == "C"
        assert float((out - ref).norm() / ref.norm()) < 0.1


def test_the_run_plans_with_its_own_sigmas_cfg_and_branches(flux, conds, monkeypatch):
    """The plan is made once per run from the sampler's sigmas, the guider's CFG and whether an uncond
    runs (none at CFG 1), and the run's per-cond pattern is the plan (H: the cond computed, the uncond not)."""
    calibrated(flux, conds)
    made = []
    real = P().step_schedule.plan

    def spy(table, sigmas, threshold, cfg, two, mode, k, allowed):
        made.append((len(sigmas) - 1, cfg, two, mode))
        return real(table, sigmas, threshold, cfg, two, mode, k, allowed)

    monkeypatch.setattr(P().step_schedule, "plan", spy)
    sample(scheduled(flux, 0.05), conds, steps=10, cfg=3.0)
    sample(scheduled(flux, 0.05, "extrapolate"), conds, steps=7, cfg=1.0)
    assert made == [(10, 3.0, True, "reuse"), (7, 1.0, False, "extrapolate")]
    monkeypatch.setattr(P().step_schedule, "plan", lambda *a, **k: S().Plan(tuple("CSHCHSSHCC"), (0.0,) * 10))
    sample(scheduled(flux, 0.05), conds)
    run = last_run()
    assert run["conds"]["cond"]["pattern"] == "CSCCCSSCCC" and run["conds"]["uncond"]["pattern"] == "CSSCSSSSCC"
    assert run["speedup_calls"] == pytest.approx(20 / 11)


def test_a_cond_only_step_runs_the_blocks_on_the_cond_rows_alone(flux, conds, monkeypatch):
    calibrated(flux, conds)
    rows = []
    block = flux.model.diffusion_model.double_blocks[0]
    handle = block.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["img"].shape[0]), with_kwargs=True)
    try:
        monkeypatch.setattr(P().step_schedule, "plan", lambda *a, **k: S().Plan(tuple("CHHCH"), (0.0,) * 5))
        out = sample(scheduled(flux, 0.05), conds, steps=5)
    finally:
        handle.remove()
    assert rows == [2, 1, 1, 2, 1] and torch.isfinite(out).all()


def test_an_uncond_called_apart_from_its_cond_is_rebuilt_from_the_conds_call_at_that_step(flux, conds):
    """Cond and uncond in separate calls (as ComfyUI runs them when they do not batch): on an H step the
    cond's call computes, the uncond's call is rebuilt from it; on the same input as the computed step it
    gives the uncond's computed output."""
    m = scheduled(flux, 1.0)
    to = m.model_options["transformer_options"].copy()
    settings = to[P().KEY]
    run = tc().RunState(P().resolved_config(settings.config, settings.family), None, 1.0, 0.0)
    run.set_plan(S().Plan(("C",), (0.0,)), [0.5, 0.0])
    to.update({"wrappers": m.wrappers, P().RUN_KEY: run})
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.5])
    pos, neg = conds

    def call(cond, key, label, step):  # the calls of one step share its timestep tensor, as a sampler's do
        opts = dict(to, sigmas=step, uuids=[key], cond_or_uncond=[label])
        with torch.inference_mode():
            return m.model.apply_model(x, step, c_crossattn=cond[0][0], y=cond[0][1]["pooled_output"],
                                       transformer_options=opts)

    first = [call(pos, "c", 0, sigma), call(neg, "u", 1, sigma)]
    run.plan = S().Plan(("H",), (0.0,))
    step = sigma.clone()  # the next step, at the same sigma: a tensor of its own
    second = [call(pos, "c", 0, step), call(neg, "u", 1, step)]
    assert [s.pattern for s in run.conds.values()] == [["C", "C"], ["C", "S"]]
    for a, b in zip(first, second, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_a_two_call_sampler_is_held_to_the_skip_limit_and_the_window_per_call(flux, conds):
    """dpm_2 calls the model twice a step (its step's sigma and a midpoint), both under the step's plan: each
    call keeps the skip limit and the window itself. Both calls of a planned skip were skipped under a limit of
    1 (two in a row), and a midpoint call above the window's start was skipped."""
    import comfy.samplers

    calibrated(flux, conds, 12)
    ref = sample(flux, conds, 12, sampler="dpm_2")

    def run(**settings):
        values = dict(rule="schedule", threshold=0.5, model_type="calibrated", start_percent=0.0, end_percent=1.0,
                      max_consecutive_skips=0, cache_device="device", residual_mode="extrapolate") | settings
        out = sample(N().TeaCacheNode.execute(model=flux, **values).args[0], conds, 12, sampler="dpm_2")
        return out, [last_run()["conds"][label]["pattern"] for label in ("cond", "uncond")]

    out, patterns = run(max_consecutive_skips=1)
    assert all("S" in p and "SS" not in p for p in patterns), patterns
    assert float((out - ref).norm() / ref.norm()) < 0.05
    sampling = flux.get_model_object("model_sampling")
    sigmas = [float(s) for s in comfy.samplers.calculate_sigmas(sampling, "simple", 12)]
    midpoint = math.exp((math.log(sigmas[2]) + math.log(sigmas[3])) / 2)  # the sixth call's
    start = (midpoint + sigmas[3]) / 2  # below the midpoint, above the next step's sigma
    percent = next(p / 10000 for p in range(10000) if float(sampling.percent_to_sigma(p / 10000)) <= start)
    assert midpoint > float(sampling.percent_to_sigma(percent)) > sigmas[3]
    _, patterns = run(start_percent=percent)
    assert all(p.startswith("CCCCCC") and "S" in p for p in patterns), patterns


def test_the_plan_holds_its_steps_to_the_window_as_each_call_is_and_a_cut_off_half_step_counts(flux, conds,
                                                                                             monkeypatch):
    """The plan read the window in float64, each call in float32: where end_percent's sigma rounds onto a step's,
    the plan skipped a step its call then computed (the run no longer followed its plan). An interrupt inside a
    cond-only step counts it as a half call, as a run that completes does."""
    import comfy.model_management

    calibrated(flux, conds)
    plans = []
    set_plan = tc().RunState.set_plan
    monkeypatch.setattr(tc().RunState, "set_plan",
                        lambda self, plan, *args: (plans.append("".join(plan.actions)), set_plan(self, plan, *args))[1])

    def run(end_percent):
        sample(N().TeaCacheNode.execute(model=flux, rule="schedule", threshold=0.5, model_type="calibrated",
                                        start_percent=0.0, end_percent=end_percent, max_consecutive_skips=0,
                                        cache_device="device", residual_mode="reuse").args[0], conds)
        return [last_run()["conds"][label]["pattern"] for label in ("cond", "uncond")]

    for end_percent in (0.2, 0.5, 0.6, 0.8):  # 0.5: its sigma rounds onto the sixth step's in float32
        assert run(end_percent) == [plans[-1].replace("H", "C"), plans[-1].replace("H", "S")], (end_percent, plans[-1])
    half = plans[-1].index("H")  # a call per step: the (half + 1)th call is the cond-only step
    final = flux.model.diffusion_model.final_layer
    seen = []

    def cut(x, *args, **kwargs):
        seen.append(1)
        if len(seen) == half + 1:
            raise comfy.model_management.InterruptProcessingException()
        return type(final).forward(final, x, *args, **kwargs)

    monkeypatch.setattr(final, "forward", cut)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        run(0.8)
    report = last_run()
    assert report["outcome"] == "interrupted" and report["calls_half"] == 1
    assert report["calls_computed"] == report["conds"]["cond"]["pattern"].count("C")


def test_the_rule_without_a_calibration_is_a_clear_error(flux, conds):
    with pytest.raises(ValueError, match="no calibration"):
        sample(scheduled(flux, 0.05), conds)


@pytest.mark.parametrize("moved,replanned", [(0.5, True), (0.05, False)])
def test_a_stretch_whose_forecast_erred_more_than_the_table_said_replans_the_rest_tighter(moved, replanned):
    """The verify step: at a computed step that ends a stretch, the cond's forecast there against what it
    computed, where the table predicted a relative error of 0.1: erring almost 4 times more, the rest of
    the run is planned again with the threshold divided by that ratio, and followed; erring half of it,
    the plan stays."""
    run = tc().RunState(tc().StepCacheConfig(None, "auto", 0.1, rule="schedule", residual_mode="reuse"), None, 1.0,
                        0.0)
    asked = []

    def replan(step, threshold):
        asked.append((step, threshold))
        return S().Plan(("C", "C", "C"), (0.0,) * 3, (0.0,) * 3)

    sigmas = [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]
    run.set_plan(S().Plan(tuple("CSCSC"), (0.0,) * 5, (0.0, 0.0, 0.1, 0.0, 0.1)), sigmas, replan)
    r0 = torch.ones(4)
    r2 = r0 + torch.tensor([2 * moved, 0.0, 0.0, 0.0])
    decided = []
    for k, sigma in enumerate(sigmas[:-1]):
        roles = run.decide_scheduled(["c"], ["cond"], [torch.zeros(1, 4)], (4,), sigma)
        decided.append(roles[0])
        if roles[0] == "C":
            run.store_residual("c", {0: r0, 2: r2}.get(k, r2), torch.tensor(sigma))
    err = float((r2 - r0).norm() / r2.norm())
    assert (err / 0.1 > S().VERIFY_MARGIN) == replanned
    if replanned:
        assert asked == [(2, pytest.approx(0.1 / (err / 0.1)))] and run.replans == 1
        assert "".join(decided) == "CSCCC"
    else:
        assert asked == [] and run.replans == 0 and "".join(decided) == "CSCSC"


def test_threshold_minus_one_takes_the_familys_schedule_threshold(flux):
    family = P().detect_family(flux)
    config = tc().StepCacheConfig(None, "auto", -1.0, rule="schedule", residual_mode="auto")
    resolved = P().resolved_config(config, family)
    assert resolved.rule == "schedule" and resolved.threshold == tc().RULE_THRESHOLDS["flux"]["schedule"] > 0


def test_a_calibrated_table_borrows_the_shipped_tables_sensitivity_read_at_its_sigmas(flux, conds, monkeypatch):
    calibrated(flux, conds)
    grid = flow_sigmas(4)[:-1]
    shipped = dataclasses.replace(table_of(residual_fn(7), grid), sensitivity=(4.0, 3.0, 2.0, 1.0))
    monkeypatch.setattr(S(), "shipped_table", lambda family: shipped if family == "flux" else None)
    m = scheduled(flux, 0.05)
    table = P().resolve(m.model_options["transformer_options"][P().KEY], m).table
    want = []
    for s in table.sigmas:  # linear in sigma between the shipped table's steps, its ends beyond them
        if s >= grid[0] or s <= grid[-1]:
            want.append(4.0 if s >= grid[0] else 1.0)
        else:
            i = next(i for i in range(3) if grid[i] >= s >= grid[i + 1])
            w = (grid[i] - s) / (grid[i] - grid[i + 1])
            want.append(shipped.sensitivity[i] * (1 - w) + shipped.sensitivity[i + 1] * w)
    assert table.sensitivity == pytest.approx(tuple(want))
    monkeypatch.setattr(S(), "shipped_table", lambda family: None)
    assert P().resolve(m.model_options["transformer_options"][P().KEY], m).table.sensitivity is None


def shipped(family):
    """The table shipped for ``family`` (caching/schedule_tables.json), read past the autouse patch."""
    import json

    return S().ResidualTable.from_json(json.loads(S().TABLES.read_text())["tables"].get(family))


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_the_shipped_tables_plan_runs_of_step_counts_they_were_not_measured_at(family):
    """Each shipped table (measured at 50 steps, with a sensitivity) plans 20, 28, 37 and 50 steps under
    Flux's and Wan's schedules: a computed first step, every stretch within the threshold, and more
    saved with a higher threshold."""
    table = shipped(family)
    assert table is not None and len(table.sigmas) == 50 and table.sensitivity is not None
    for steps in (20, 28, 37, 50):
        sigmas = flow_sigmas(steps, 3.0 if family == "flux" else 5.0)
        costs = []
        for threshold in (0.005, 0.0245, 0.1):
            plan = S().plan(table, sigmas, threshold, 3.5, True, "extrapolate")
            assert plan.actions[0] == "C" and len(plan.actions) == steps and max(plan.errors) <= threshold
            costs.append(sum({"C": 1.0, "H": 0.5, "S": 0.0}[a] for a in plan.actions))
        assert costs == sorted(costs, reverse=True) and costs[-1] < costs[0] <= steps


def test_the_node_defaults_run_teacache_until_the_model_has_its_own_schedule_table(flux, conds, monkeypatch):
    """The shipped table was measured on the bench's stand-in, not on this model: the node's defaults run
    TeaCache's published polynomial on it (never the shipped table), and the schedule rule at its own
    default threshold once this model is calibrated; a threshold set by hand keeps TeaCache's meaning, and so
    does the output forecast set by hand."""
    monkeypatch.setattr(S(), "shipped_table", shipped)
    defaults = {i.id: i.default for i in N().TeaCacheNode.define_schema().inputs if i.id != "model"}
    (m,) = N().TeaCacheNode.execute(model=flux, **defaults).args
    sample(m, conds)
    run = last_run()
    rule, anchors, mode = tc().FAMILY_DEFAULTS["flux"]
    assert (run["rule"], run["threshold"], run["residual_mode"]) == (
        "teacache", tc().default_threshold(anchors, run["steps"]), mode)
    calibrated(flux, conds)
    out = sample(m, conds)
    run = last_run()
    assert (run["rule"], run["residual_mode"], run["model_type"]) == ("schedule", "extrapolate", "calibrated")
    assert run["threshold"] == tc().RULE_THRESHOLDS["flux"]["schedule"] and torch.isfinite(out).all()
    assert run["calls_skipped"] + run["calls_half"] > 0
    (by_hand,) = N().TeaCacheNode.execute(model=flux, **{**defaults, "threshold": 0.4}).args
    sample(by_hand, conds)
    assert (last_run()["rule"], last_run()["threshold"]) == ("teacache", 0.4)
    (output,) = N().TeaCacheNode.execute(model=flux, **{**defaults, "residual_mode": "output"}).args
    sample(output, conds)  # the output forecast set by hand: the schedule rule plans residuals, so TeaCache
    assert (last_run()["rule"], last_run()["residual_mode"], last_run()["model_type"]) == (
        "teacache", "output", "calibrated")
