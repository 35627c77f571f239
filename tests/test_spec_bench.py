"""``benchmarks/spec.py --smoke``: the speculative decoding benchmark runs end to end on a CPU in seconds (the copy
toy untrained), every mode at every row count, greedy tokens identical to plain decoding, its JSON the rows it
printed."""

import json

import numpy as np
import pytest

from helpers.bench import import_bench


@pytest.mark.slow
def test_spec_benchmark_smoke(tmp_path, capsys):
    bench = import_bench("spec")
    out = tmp_path / "spec.json"
    report = bench.main(["--smoke", "--json", str(out)])
    printed = capsys.readouterr().out
    rows = report["rows"]
    want = {n: [m for m, *_ in bench.modes(bench.SMOKE["ks"], rows=n)] for n in bench.SMOKE["rows"]}
    assert "plain burst 32" in want[1]
    assert "plain burst 32" not in [m for m, *_ in bench.modes(bench.SMOKE["ks"], rows=65)]  # a mode's row cap
    assert len(report["mtp_accuracy_per_step"]) == max(bench.SMOKE["ks"])
    assert set(report["free_running"]) == {"agreement", "perfect", "first_error"}
    assert "continue the prompt's period" in printed
    assert [(r["rows"], r["mode"]) for r in rows] == [(n, m) for n in bench.SMOKE["rows"] for m in want[n]]
    flat = report["flat_tokens_measured"]
    assert flat is None or flat >= 1
    measured = next(r for r in rows if r["mode"].endswith("measured rule"))
    assert measured["verify_steps"] >= 0
    for r in rows:
        assert r["identical"] is True, (r["rows"], r["mode"])  # greedy: speculation never changes a token
        assert r["tok_s"] > 0 and r["steps"] > 0 and r["tok_per_cost"] > 0
        assert f"| {r['rows']} | {r['mode']} |" in printed
        if r["mode"] == "plain":
            assert r["vs_plain"] == 1.0 == r["model_vs_plain"] and r["verify_steps"] == 0
        elif r["mode"].startswith("plain") or "measured rule" in r["mode"]:
            # no drafts, or the choice of a rule whose flat region this run's (noisy CPU) timings measured
            assert r["verify_steps"] >= 0
        else:  # the copy prompts repeat a pattern: prompt lookup always finds drafts
            assert r["verify_steps"] > 0 and 0 < r["drafts_proposed"], (r["rows"], r["mode"])
            assert 0.0 <= r["acceptance_rate"] <= 1.0
            assert 1.0 <= r["tokens_per_verify_row"] <= 1 + max(bench.SMOKE["ks"])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows, default=float))


def test_modes_table_expands_per_draft_length():
    """A mode is one line of data: ``{k}`` expands over every K ("each") or the largest ("max"), with its Engine
    settings."""
    bench = import_bench("spec")
    by_name = {m[0]: m for m in bench.MODES}
    table = tuple(by_name[n] for n in ("plain", "plain burst 32", "ngram K={k}", "ngram K={k} rule off", "mtp K={k}"))
    table += (("mtp K={k} burst", dict(method="mtp"), dict(decode_burst=4), "each"),
              ("mtp K={k} measured", dict(method="mtp", flat_tokens=bench.MEASURED), {}, "max"))
    got = bench.modes((2, 4), table, rows=65, flat_tokens=37)  # past "plain burst 32"'s cap
    assert [m[0] for m in got] == ["plain", "ngram K=2", "ngram K=4", "ngram K=4 rule off", "mtp K=2", "mtp K=4",
                                   "mtp K=2 burst", "mtp K=4 burst", "mtp K=4 measured"]
    assert got[0][1] is None and got[3][1].flat_tokens is None and got[5][1].method == "mtp"
    assert [m[1].num_draft_tokens for m in got[1:]] == [2, 4, 4, 2, 4, 2, 4, 4]
    assert got[-2][2] == {"decode_burst": 4} and got[4][2] == {"decode_burst": 1} == got[1][2]
    burst = bench.modes((2, 4), (by_name["ngram K={k} burst 32 measured rule"],), rows=64, flat_tokens=37)
    assert [(m[0], m[1].method, m[1].num_draft_tokens, m[1].flat_tokens, m[2]) for m in burst] == [
        ("ngram K=4 burst 32 measured rule", "ngram", 4, 37, {"decode_burst": 32})]
    assert got[-1][1].flat_tokens == 37  # MEASURED: the run's measured region
    from kvjax.sched.drafter import FLAT_TOKENS

    assert bench.modes((4,), table[-1:])[0][1].flat_tokens == FLAT_TOKENS  # none measured: the default
    one = [m[0] for m in bench.modes((4,), table, rows=1)]
    assert one[:2] == ["plain", "plain burst 32"] and bench.modes((4,), table[1:2])[0][2] == {"decode_burst": 32}


def test_flat_tokens_from_fits_the_sub_step_time():
    """``flat_tokens_from``: the tokens at which a linear fit of the sub-step time doubles its intercept; ``None``
    where the time does not grow; a clear error for too few row counts."""
    import numpy as np
    import pytest

    from kvjax.experiments.spec_runs import flat_tokens_from

    rng = np.random.default_rng(0)
    a, b = rng.uniform(2e-4, 4e-4), rng.uniform(3e-6, 6e-6)
    rows = [1, 16, 64]
    assert flat_tokens_from(rows, [a + b * r for r in rows]) == round(a / b)
    assert flat_tokens_from([1, 64], [a, a * 0.99]) is None
    for bad_rows, times in (([8], [a]), ([4, 4], [a, a]), ([1, 2], [a])):
        with pytest.raises(ValueError, match="distinct row counts"):
            flat_tokens_from(bad_rows, times)


def test_copy_task_sequences_copy_a_period_back():
    import numpy as np
    import pytest

    from kvjax.experiments.spec_runs import CopyTask, NoisyDrafter
    from kvjax.sched.drafter import NgramDrafter

    task = CopyTask(vocab=40, length=50, min_period=3, max_period=9, max_prefix=12)
    x, t, m, periods = task.sample(np.random.default_rng(0), 64)
    assert x.shape == t.shape == m.shape == (64, 50) and (x[:, 0] == 0).all() and (x[:, 1:] > 0).all()
    np.testing.assert_array_equal(t[:, :-1], x[:, 1:])
    for row, mask, p in zip(x, m, periods.tolist()):
        idx = np.flatnonzero(mask)
        assert idx.size >= 50 - 2 - 12 - 2 * 9 and idx[-1] == 48  # copies run to the end
        np.testing.assert_array_equal(row[idx + 1], row[idx + 1 - p])  # each target is the token a period back
        start = idx[0] + 1 - p  # the pattern's first token: distinct tokens over a period
        assert len(set(row[start: start + p].tolist())) == p and 0 <= start - 1 <= 12
    prefix = np.arange(5, 12)
    for prompt in task.prompts(np.random.default_rng(1), 8, 20, prefix=prefix):
        assert prompt.shape == (28,) and prompt[0] == 0 and (prompt[1:8] == prefix).all()
        body = prompt[8:]
        p = next(q for q in range(1, 11) if (body[q:] == body[:-q]).all())  # periodic, at least twice over
        assert 3 <= p <= 9 and len(set(body[:p].tolist())) == p
    for bad in (dict(min_period=0), dict(max_period=40), dict(length=19), dict(max_prefix=-1)):
        with pytest.raises(ValueError):
            CopyTask(**{**dict(vocab=40, length=50, min_period=3, max_period=9), **bad})
    toks = np.array([0, 4, 5, 6, 7, 4, 5, 6, 7, 4], np.int32)
    inner = NgramDrafter(4)
    assert NoisyDrafter(inner, 0.0, 40).propose(toks, 4).tolist() == inner.propose(toks, 4).tolist() == [5, 6, 7, 4]
    noisy = NoisyDrafter(inner, 1.0, 40, seed=3).propose(toks, 4)
    assert noisy.shape == (4,) and (noisy != [5, 6, 7, 4]).all() and ((0 <= noisy) & (noisy < 40)).all()


def test_idle_layers_change_no_logit():
    """The appended GDN layer (zero output projections) leaves every logit of the attention-only model as it was,
    while its own weights stay random (its state updates are real work)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from kvjax.experiments.spec_runs import CopyTask, copy_model, with_idle_layers

    task = CopyTask(vocab=32, length=24, min_period=3, max_period=6)
    model = copy_model(task, hidden=32, layer_types=("full_attention", "full_attention"), seed=3)
    hybrid = with_idle_layers(model)
    assert hybrid.config.layer_types == ("full_attention", "full_attention", "linear_attention")
    x, *_ = task.sample(np.random.default_rng(5), 6)
    np.testing.assert_array_equal(np.asarray(hybrid.logits(jnp.asarray(x))), np.asarray(model.logits(jnp.asarray(x))))
    gdn = {p[-2:]: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(hybrid, nnx.Param))
           if p[:3] == ("model", "layers", 2)}
    assert not gdn["out_proj", "kernel"].any() and not gdn["down_proj", "kernel"].any()
    assert gdn["in_proj_qkv", "kernel"].std() > 0


def test_free_running_scores_greedy_continuations_against_the_period():
    """``greedy_generate`` is greedy decoding (a step-by-step loop over the full sequence is the reference);
    ``free_running`` scores it against each prompt's periodic continuation; ``prompt_period`` finds the period."""
    import jax.numpy as jnp
    import numpy as np
    import pytest

    from kvjax.experiments.spec_runs import CopyTask, copy_model, free_running, greedy_generate, prompt_period

    assert prompt_period(np.array([0, 5, 6, 7, 5, 6, 7, 5])) == 3
    assert prompt_period(np.array([9, 9, 4, 4, 4, 4]), start=2) == 1
    with pytest.raises(ValueError, match="repeats no pattern"):
        prompt_period(np.array([0, 1, 2, 3, 1, 2]))
    task = CopyTask(vocab=16, length=24, min_period=2, max_period=4)
    model = copy_model(task, hidden=32, layer_types=("full_attention",), seed=4)
    prompts = task.prompts(np.random.default_rng(2), 6, 9)
    gen = greedy_generate(model, prompts, 5)
    for p, g in zip(prompts, gen):
        seq = list(p)
        for _ in range(5):
            seq.append(int(jnp.argmax(model.logits(jnp.asarray([seq]))[0, -1])))
        assert g.tolist() == seq[len(p):]
    want = np.stack([np.resize(p[1:][: prompt_period(p)], 9 + 5)[9:] for p in prompts])
    ok = gen == want
    fr = free_running(model, prompts, 5)
    assert fr["agreement"] == pytest.approx(ok.mean()) and fr["perfect"] == pytest.approx(ok.all(axis=1).mean())
    first = [next((i for i in range(5) if not row[i]), 5) for row in ok]
    assert fr["first_error"] == pytest.approx(np.mean(first) / 5)


@pytest.mark.parametrize("repeats", [0, 1.5, True])
def test_spec_run_refuses_a_bad_repeat_count(repeats):
    from kvjax.experiments import spec_runs

    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        spec_runs.spec_run(None, [np.arange(3)], 2, rows=1, repeats=repeats)


def test_toy_cache_round_trips_the_parameters(tmp_path):
    """``--toy-cache``: :func:`save_params` / :func:`load_params` put a (perturbed, so a load that does nothing fails)
    toy and MTP layer into a fresh pair of the same recipe exactly; ``build`` then loads instead of training."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kvjax.experiments import spec_runs

    bench = import_bench("spec")
    cfg = bench.SMOKE
    task = spec_runs.CopyTask(**cfg["task"])

    def fresh():
        toy, _ = spec_runs.train_copy(task, cfg["model"], cfg["train"])
        return toy, spec_runs.copy_mtp(toy, task, **cfg["mtp"])[0]

    toy, head = fresh()
    rng = np.random.default_rng(0)
    for m in (toy, head):
        nnx.update(m, jax.tree.map(lambda x: x + jnp.asarray(rng.standard_normal(x.shape), x.dtype), nnx.state(m)))
    path = bench.toy_file(str(tmp_path), cfg)
    bench.save_params(path, toy=toy, mtp=head)
    other, other_head = fresh()
    bench.load_params(path, toy=other, mtp=other_head)
    for a, b in ((toy, other), (head, other_head)):
        for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    model, figures = bench.build(cfg, str(tmp_path))  # the perturbed pair, loaded: no training
    assert figures["copy_accuracy"] == spec_runs.copy_accuracy(toy, task, np.random.default_rng(1))
