"""One cost game: every caller that prices a step, a subset or tokens gives the numbers of `llmvisor.core.game`.

On seeded random traces (prefill, decode-only and mixed steps; with and without shared KV prefixes) and random
models (one or two segments, the effective-context coefficient e zero or not), each caller is compared with the
game: attribution (offline and online), the fitted model's prediction, validation's subset costs, shares and
token split, the fair scheduler's charges, admission predictions and reservations, the token_count baseline,
the demo's and the fairness experiment's token service. A caller with a formula of its own that differs in
any term (say, without e·ĉ) fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression

from llmvisor.core import game
from llmvisor.core.attribution import RULES, StepAttributor, attribute, attribute_arrays
from llmvisor.core.features import FEATURE_NAMES
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S, synthetic_trace
from llmvisor.core.trace import TraceWriter, sharing_columns_from_blocks
from llmvisor.evaluation.baselines import TokenCountBaseline
from llmvisor.fairness.experiment import analyse_run
from llmvisor.fairness.policy import AdmissionController, FairnessConfig, FairShare
from llmvisor.report.demo import token_service
from llmvisor.validation.analysis import model_shares, model_step_s, model_subset_costs, token_count_split
from llmvisor.validation.plans import SampledBatchSpec

BASE = np.array([DEFAULT_COEF_S[name] for name in FEATURE_NAMES])
E = FEATURE_NAMES.index("effective_context_tokens")
CASES = [(seed, segments, sharing) for seed in (0, 1) for segments in (1, 2) for sharing in (False, True)]


def random_model(rng, segments: int, sharing: bool) -> StepLatencyModel:
    """Independent positive coefficients per segment; e > 0 when ``sharing``; a boundary that many steps straddle."""
    coef_sets = []
    for _ in range(segments):
        coef = BASE * rng.uniform(0.2, 5.0, size=BASE.size)
        coef[E] = rng.uniform(1e-7, 1e-6) if sharing else 0.0
        coef_sets.append(coef)
    boundary = float(rng.uniform(20, 300)) if segments == 2 else None
    return StepLatencyModel.from_coefficients([dict(zip(FEATURE_NAMES, c)) for c in coef_sets], boundary)


def random_trace(seed: int, sharing: bool):
    return synthetic_trace(80, max_batch_size=10, max_new_tokens=400, shared_prefix_fraction=0.7 if sharing else 0.0, seed=seed)


def effective_of(trace):
    return trace.effective_context_tokens if trace.has_sharing_columns else None


def steps_of(trace):
    e = effective_of(trace)
    for k in range(trace.n_steps):
        s = slice(int(trace.step_offsets[k]), int(trace.step_offsets[k + 1]))
        yield k, s, (trace.num_new_tokens[s].astype(np.float64), trace.num_context_tokens[s].astype(np.float64),
                     trace.is_prefill[s], None if e is None else e[s].astype(np.float64))


def bill(basis: np.ndarray, target: float, *, clip: bool = True) -> np.ndarray:
    """A rule's shares from its basis: clipped at 0 and scaled to ``target`` (an equal split when all are 0)."""
    basis = np.maximum(basis, 0.0) if clip else basis
    return basis * (target / basis.sum()) if basis.sum() > 0 else np.full(basis.size, target / basis.size)


def game_shares(model, rule: str, new, context, is_prefill, effective, target: float | None) -> np.ndarray:
    """What each rule bills, from the game alone."""
    offsets = np.array([0, new.size])
    prices = game.step_prices(model.coef_, model.boundary_, new, context, is_prefill, offsets, effective)
    total = float(prices.predicted_s[0]) if target is None else target
    if rule == "paper":
        return prices.own_s
    if rule == "proportional":
        return bill(prices.own_s, total)
    return bill(game.shapley_s(model.coef_, model.boundary_, new, context, is_prefill, offsets, effective), total)


def subset_price_s(model, new, context, is_prefill, members, effective) -> float:
    """v(S) as the game's price of a step holding S alone."""
    return game.step_price_s(model.coef_, model.boundary_, new[members], context[members], is_prefill[members], effective)


@pytest.fixture(params=CASES, ids=[f"seed{s}-{g}seg-{'shared' if h else 'unshared'}" for s, g, h in CASES])
def case(request):
    seed, segments, sharing = request.param
    rng = np.random.default_rng([seed, segments, sharing])
    return random_model(rng, segments, sharing), random_trace(seed, sharing), rng


def test_the_game_prices_a_step_as_the_fitted_model_predicts_it(case):
    model, trace, _ = case
    prices = game.step_prices(model.coef_, model.boundary_, trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill,
                              trace.step_offsets, effective_of(trace))
    np.testing.assert_allclose(prices.predicted_s, model.predict(trace), rtol=1e-10)
    one_by_one = [game.step_price_s(model.coef_, model.boundary_, *step) for _, _, step in steps_of(trace)]
    np.testing.assert_allclose(one_by_one, prices.predicted_s, rtol=1e-12)
    np.testing.assert_array_equal(game.segments_of(model.boundary_, prices.load), model.segment_of_steps(prices.load))
    if model.boundary_ is not None:  # the random boundary makes some steps straddle it, so the exact path is tried
        assert game.straddling_steps(model.boundary_, trace.num_new_tokens, trace.step_offsets, prices.load).any()


def test_attribution_offline_and_online_bills_the_games_values(case):
    model, trace, _ = case
    assert (~trace.is_prefill_per_step).any() and trace.is_prefill_per_step.any()  # the decode fast path and the general one
    measured = trace.step_latency_s_per_step * np.random.default_rng(3).uniform(0.8, 1.25, trace.n_steps)
    for rule in RULES:
        offline_predicted = attribute(model, trace, rule, use_measured=False)
        offline = attribute_arrays(model, trace.num_new_tokens, trace.num_context_tokens, trace.is_prefill, trace.step_offsets,
                                   measured, rule, effective_of(trace))
        online = StepAttributor(model, rule)
        for k, s, (new, context, is_prefill, effective) in steps_of(trace):
            price = game.step_price_s(model.coef_, model.boundary_, new, context, is_prefill, effective)
            assert offline.predicted_step_s[k] == pytest.approx(price, rel=1e-12)
            assert online.predict_step_s(new, context, is_prefill, effective) == pytest.approx(price, rel=1e-12)
            expected = game_shares(model, rule, new, context, is_prefill, effective, None)
            np.testing.assert_allclose(offline_predicted.share_s[s], expected, rtol=1e-10, atol=1e-15)
            np.testing.assert_allclose(online.attribute(new, context, is_prefill, None, effective), expected, rtol=1e-10, atol=1e-15)
            target = None if rule == "paper" else float(measured[k])
            expected = game_shares(model, rule, new, context, is_prefill, effective, target)
            np.testing.assert_allclose(offline.share_s[s], expected, rtol=1e-10, atol=1e-15)
            np.testing.assert_allclose(online.attribute(new, context, is_prefill, target, effective), expected, rtol=1e-10, atol=1e-15)


def test_validation_prices_subsets_and_splits_tokens_by_the_game(case):
    model, trace, _ = case
    shared = trace.extra.get("num_shared_context_tokens")
    checked = 0
    for k, s, (new, context, is_prefill, effective) in steps_of(trace):
        if new.size > 7:
            continue
        checked += 1
        n = new.size
        costs = model_subset_costs(model, new, context, is_prefill)
        np.testing.assert_allclose(costs, game.subset_costs_s(model, new, context, is_prefill), rtol=1e-12)
        for mask in range(1, 1 << n):
            members = [i for i in range(n) if mask >> i & 1]
            assert costs[mask] == pytest.approx(subset_price_s(model, new, context, is_prefill, members, None), rel=1e-10)
        measured = float(trace.step_latency_s_per_step[k])
        shares = model_shares(model, new, context, is_prefill, measured, effective)
        for rule in RULES:
            np.testing.assert_allclose(shares[rule], game_shares(model, rule, new, context, is_prefill, effective, None if rule == "paper" else measured),
                                       rtol=1e-10, atol=1e-15)
            if rule != "paper":
                np.testing.assert_allclose(shares[f"{rule}_predicted"], game_shares(model, rule, new, context, is_prefill, effective, None), rtol=1e-10, atol=1e-15)
        np.testing.assert_allclose(token_count_split(new, is_prefill), game.VTC_TOKEN_PRICES.step_fractions(new, is_prefill))
        if shared is None or not shared[s].any():
            continue
        # The shared prefix: validation's sampled-batch game and the block game both price a subset as the step
        # holding it alone, the prefix's blocks split among the subset's readers (trace.py's split, independent).
        prefix_tokens = float(shared[s].max())
        readers = np.flatnonzero(shared[s] > 0)
        spec = SampledBatchSpec(k, "shared_prefix_decode", "test", tuple(int(v) for v in new), tuple(int(v) for v in context),
                                tuple(bool(v) for v in is_prefill), tuple(int(v) for v in shared[s]), ((tuple(range(n))),))
        step_s = model_step_s(model)
        block_costs = game.subset_costs_s(model, new, context, is_prefill, [(prefix_tokens, readers)])
        for mask in range(1, 1 << n):
            members = [i for i in range(n) if mask >> i & 1]
            inside = [j for j, i in enumerate(members) if i in set(readers.tolist())]
            _, sub_effective = sharing_columns_from_blocks(context[members].astype(np.int64), [(int(prefix_tokens), inside)] if inside else [])
            expected = subset_price_s(model, new, context, is_prefill, members, sub_effective)
            assert step_s(spec, mask) == pytest.approx(expected, rel=1e-10)
            assert block_costs[mask] == pytest.approx(expected, rel=1e-10)
        np.testing.assert_allclose(game.shared_prefix_effective_context(context, shared[s]), effective, rtol=1e-12)
    assert checked >= 10


def test_the_fair_schedulers_charges_and_predictions_are_the_games(case):
    model, trace, rng = case
    fair = FairShare(FairnessConfig(cost="attributed"), model)
    admission = AdmissionController(model, tpot_slo_s=None, max_chunk_tokens=256)
    for k, s, (new, context, is_prefill, effective) in steps_of(trace):
        tenants = trace.tenant[s].tolist()
        measured = float(trace.step_latency_s_per_step[k])
        charge = fair.charge_step(tenants, new, context, is_prefill, np.ones(new.size, bool), measured, float(k), effective)
        expected = game_shares(model, "shapley", new, context, is_prefill, effective, measured)
        per_tenant: dict[str, float] = {}
        for tenant, share in zip(tenants, expected):
            per_tenant[tenant] = per_tenant.get(tenant, 0.0) + share
        assert charge.cost == pytest.approx(per_tenant, rel=1e-10)
        # Admission: a decode step of the running requests, before and after one more (every context its own).
        decodes = context[~is_prefill]
        n = decodes.size
        if n:
            step = (np.ones(n), decodes, np.zeros(n, bool))
            assert admission.decode_step_s(n, float(decodes.sum())) == pytest.approx(game.step_price_s(model.coef_, model.boundary_, *step), rel=1e-12)
        prompt, cached = int(rng.integers(1, 900)), int(rng.integers(0, 300))
        chunks, total, position = [], 0.0, cached
        while position < prompt:  # each chunk's own term in the step it shares with the n running decodes
            p = min(prompt - position, 256)
            batch = (np.r_[float(p), np.ones(n)], np.r_[float(position), decodes], np.r_[True, np.zeros(n, bool)])
            total += game.step_prices(model.coef_, model.boundary_, *batch, np.array([0, n + 1])).own_s[0]
            chunks.append(p)
            position += p
        assert admission.prefill_cost_s(prompt, cached, n) == pytest.approx(total, rel=1e-12, abs=0.0)
        decision = admission.decide(n, float(decodes.sum()), prompt, cached, output_tokens=7)
        after = (np.ones(n + 1), np.r_[decodes, float(prompt)], np.zeros(n + 1, bool))
        assert decision.decode_step_after_s == pytest.approx(game.step_price_s(model.coef_, model.boundary_, *after), rel=1e-12)
        assert decision.model_tpot_s == pytest.approx(decision.decode_step_after_s + decision.prefill_cost_s / 7, rel=1e-12)


def vtc_slice_tokens(new, is_prefill, samples_token, prompt_price=1.0, output_price=2.0):
    """VTC's definition, written out: a prefill chunk's tokens are prompt tokens (plus one output token when it
    samples), a decode slice's tokens are output tokens."""
    return np.array([p * prompt_price + s * output_price if pre else p * output_price for p, pre, s in zip(new, is_prefill, samples_token)])


def test_token_prices_are_vtcs_wherever_tokens_are_counted(case, tmp_path):
    model, trace, rng = case
    new, is_prefill = trace.num_new_tokens, trace.is_prefill
    samples = rng.random(new.size) < 0.5
    assert (game.VTC_TOKEN_PRICES.prompt, game.VTC_TOKEN_PRICES.output) == (1.0, 2.0)
    np.testing.assert_array_equal(game.VTC_TOKEN_PRICES.slice_costs(new, is_prefill, samples), vtc_slice_tokens(new, is_prefill, samples))
    unsampled = vtc_slice_tokens(new, is_prefill, np.zeros(new.size, bool))
    step_tokens = np.add.reduceat(unsampled, trace.step_starts)
    np.testing.assert_array_equal(game.VTC_TOKEN_PRICES.step_costs(new, is_prefill, trace.step_starts), step_tokens)

    # The fair scheduler's tokens cost, with configured prices, and its reservation.
    config = FairnessConfig.from_dict({"cost": "tokens", "prompt_token_cost": 1.5, "output_token_cost": 3.0})
    fair = FairShare(config)
    for k, s, (p, c, pre, _) in steps_of(trace):
        tenants = trace.tenant[s].tolist()
        charge = fair.charge_step(tenants, p, c, pre, samples[s], 0.01, float(k))
        expected: dict[str, float] = {}
        for tenant, tokens in zip(tenants, vtc_slice_tokens(p, pre, samples[s], 1.5, 3.0)):
            expected[tenant] = expected.get(tenant, 0.0) + tokens
        assert charge.cost == pytest.approx(expected, rel=1e-12)
    assert fair.reservation(700, 100) == 600 * 1.5 + 3.0
    assert FairShare(FairnessConfig(cost="tokens")).reservation(700, 100) == 600 * 1.0 + 2.0

    # The token_count baseline: a line per phase on VTC's step tokens.
    baseline = TokenCountBaseline().fit(trace)
    prefill_steps = trace.is_prefill_per_step
    for mask in (prefill_steps, ~prefill_steps):
        line = LinearRegression().fit(step_tokens[mask, None], trace.step_latency_s_per_step[mask])
        np.testing.assert_allclose(baseline.predict(trace)[mask], line.predict(step_tokens[mask, None]), rtol=1e-9)

    # The demo's token service per tenant.
    by_tenant: dict[str, float] = {}
    for tenant, tokens in zip(trace.tenant.tolist(), unsampled):
        by_tenant[tenant] = by_tenant.get(tenant, 0.0) + tokens
    assert token_service(trace) == pytest.approx(by_tenant, rel=1e-12)

    # The fairness experiment: token service and attributed time per tenant over one window.
    result = experiment_run(tmp_path, trace, rng)
    summary = analyse_run(result, model, window_s=result["end_s"], warmup_s=0.0)["summary"]
    tenants = result["tenants"]
    prompt = {t: float(new[is_prefill & (trace.tenant == t)].sum()) for t in tenants}
    output = np.asarray(result["step_output_tokens"], dtype=np.float64).sum(axis=0)
    assert summary["token_service"] == pytest.approx({t: prompt[t] * 1.0 + output[i] * 2.0 for i, t in enumerate(tenants)}, rel=1e-12)
    shares = np.concatenate([game_shares(model, "shapley", *step, float(trace.step_latency_s_per_step[k])) for k, _, step in steps_of(trace)])
    attributed = {t: float(shares[trace.tenant == t].sum()) for t in tenants}
    assert summary["attributed_s"] == pytest.approx(attributed, rel=1e-10)


def experiment_run(tmp_path, trace, rng) -> dict:
    """``trace`` as the fairness experiment's runner records a run: its steps 10 ms apart, inside one window."""
    path = tmp_path / "run.jsonl"
    tenants = sorted(set(trace.tenant.tolist()))
    effective = effective_of(trace)
    shared = trace.extra.get("num_shared_context_tokens")
    with TraceWriter(path) as writer:
        for k, s, _ in steps_of(trace):
            rows = []
            for i in range(s.start, s.stop):
                row = {"run_id": "r", "step_id": k, "step_latency_s": float(trace.step_latency_s_per_step[k]),
                       "request_id": f"{trace.request_id[i]}-x", "tenant": trace.tenant[i], "num_new_tokens": int(trace.num_new_tokens[i]),
                       "num_context_tokens": int(trace.num_context_tokens[i]), "phase": "prefill" if trace.is_prefill[i] else "decode",
                       "timestamp_s": 1000.0 + 0.01 * k}
                if effective is not None:
                    row |= {"num_shared_context_tokens": int(shared[i]), "effective_context_tokens": float(effective[i])}
                rows.append(row)
            writer.write_step(rows)
    n = trace.n_steps
    return {
        "policy": "attributed", "tenants": tenants, "trace": str(path), "first_step": 0, "t0_wall_s": 1000.0,
        "end_s": 0.01 * n + 1.0, "requests": [], "step_return_s": [0.01 * k + 0.005 for k in range(n)],
        "step_output_tokens": rng.integers(0, 4, size=(n, len(tenants))).tolist(), "recorder_overhead": {},
        "engine_start_s": 0.0, "num_arrivals": 0, "waiting_at_end": 0,
    }
