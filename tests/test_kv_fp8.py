"""Block-wise fp8 GQA pages: the cache spec and its roles, the quantising write and its fill rule, the paged
attention reference over fp8 pages (against float pages, with a bound derived from e4m3's 3 mantissa bits), the
backend table's choice for fp8 pages (decode: the split-KV kernel; prefill: the Mosaic GPU kernel on Hopper), and bad
inputs. The kernels over fp8 pages against this reference: ``tests/test_paged_attention_kernels.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.base.device import DeviceKind
from kvjax.ops.attention import TABLE, dense_attention_reference, paged_attention
from kvjax.state.kv_cache import check_gqa_cache, dequantize_pages, write_kv_cache, write_kv_fp8
from kvjax.state.registry import GQACacheSpec, cache_names, create_caches, create_host_caches, create_kv_cache

FP8 = jnp.float8_e4m3fn
REL = {"fp8": 2.0 ** -4, "bf16": 2.0 ** -8, "f32": 0.0}  # half an ulp, relative: 3 / 7 stored mantissa bits
SUB = 2.0 ** -9  # e4m3 subnormal spacing in units of the page scale (bound on the sum of its roundings)


def _spec(layer=0, page_size=4, head_dim=8, dtype=FP8):
    return GQACacheSpec(layer=layer, num_kv_heads=2, page_size=page_size, head_dim=head_dim, dtype=dtype)


def _np_scale(amax):
    """The page scale, independently: the smallest power of two ``s`` with ``amax <= 448 s`` (0 for 0)."""
    return 0.0 if amax == 0 else float(2.0 ** np.ceil(np.log2(amax / 448.0)))


def _np_quantise(x, s):
    """``x`` (f32[..., D]) quantised with scale ``s`` and read back, with ml_dtypes' e4m3 rounding."""
    if s == 0:
        return np.zeros_like(x)
    return (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s


# ------------------------------------------------------------------------------------------------ spec, roles


def test_spec_roles_names_and_order():
    caches = create_caches([_spec(layer=3), _spec(layer=1, dtype=jnp.bfloat16)], num_pages=5)
    assert list(caches) == ["key_caches_1", "value_caches_1", "key_caches_3", "value_caches_3",
                            "key_scale_caches_3", "value_scale_caches_3"]
    assert list(caches) == cache_names([_spec(layer=1, dtype=jnp.bfloat16), _spec(layer=3)], 5)
    assert caches["key_caches_3"].dtype == FP8 and caches["key_caches_3"].shape == (5, 4, 8)
    for role in ("key_scale", "value_scale"):
        x = caches[f"{role}_caches_3"]
        assert x.dtype == jnp.float32 and x.shape == (5,)  # one scale per single-head page = per (page, KV head)
    assert caches["key_caches_1"].dtype == jnp.bfloat16


def test_spec_refuses_other_fp8_formats():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        _spec(dtype=jnp.float8_e5m2)


def test_host_copies_hold_every_role():
    host = create_host_caches([_spec(layer=2)], num_pages=3)
    assert {k: (v.shape, v.dtype) for k, v in host.items()} == {
        k: (v.shape, v.dtype) for k, v in create_caches([_spec(layer=2)], 3).items()}
    assert all(v.sharding.memory_kind == "pinned_host" for v in host.values())


def test_qwen_init_caches_makes_fp8_pages_on_request():
    from helpers.models import qwen_swa_model

    model = qwen_swa_model()
    shapes = jax.eval_shape(lambda: model.init_caches(num_pages=7, page_size=4, max_seqs=2, kv_cache_dtype="fp8"))
    layer = model.config.attention_layers[0]
    assert shapes.pages[f"key_caches_{layer}"].dtype == FP8
    assert shapes.pages[f"value_scale_caches_{layer}"].shape == (7,)
    plain = jax.eval_shape(lambda: model.init_caches(num_pages=7, page_size=4, max_seqs=2))
    assert sorted(plain.pages) == [f"key_caches_{layer}", f"value_caches_{layer}"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.init_caches(num_pages=7, page_size=4, max_seqs=2, kv_cache_dtype="fp8_e5m2")


# ------------------------------------------------------------------------------------------------ writes


def _row_slots(pages_of_head, n0, n):
    """i32[n, H]: slots of positions n0 .. n0+n-1 of one row whose head h owns pages ``pages_of_head[h]``."""
    pos = np.arange(n0, n0 + n)
    return np.stack([np.asarray(pg)[pos // 4] * 4 + pos % 4 for pg in pages_of_head], axis=1).astype(np.int32)


def _values(rng, n, loud=()):
    x = rng.standard_normal((n, 2, 8)).astype(np.float32)
    x *= np.exp(rng.uniform(-3, 3, (n, 2, 1))).astype(np.float32)  # magnitudes over ~2.6 decades
    for t in loud:
        x[t] *= 64.0  # a token that raises its page's max
    return x


def _write(cache, k, v, slots, cu):
    return jax.jit(write_kv_cache)(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                                   cu_seqlens=jnp.asarray(cu, jnp.int32))


def test_write_at_once_matches_independent_quantiser(rng):
    """One write per page: the scale is the power of two of the block's max; values round as ml_dtypes rounds."""
    cache = create_kv_cache(_spec(), 12)
    pages = [[3, 7, 1], [0, 9, 5]]  # head 0 / head 1
    k, v = _values(rng, 10), _values(rng, 10)
    out = _write(cache, k, v, _row_slots(pages, 0, 10), [0, 10])
    for role, x in (("key", k), ("value", v)):
        got = np.asarray(dequantize_pages(out[role], out[f"{role}_scale"]))
        for h in range(2):
            for b, page in enumerate(pages[h]):
                block = x[4 * b: 4 * b + 4, h]
                s = _np_scale(np.abs(block).max())
                assert float(out[f"{role}_scale"][page]) == s
                np.testing.assert_array_equal(got[page, : len(block)], _np_quantise(block, s))
        untouched = sorted(set(range(12)) - {p for hp in pages for p in hp})
        assert not np.asarray(out[f"{role}_scale"])[untouched].any()


def test_fill_rule_token_by_token_equals_at_once(rng):
    """A page written over several steps (chunks, then decode tokens, a loud token raising its max late) holds the
    same values as the page written at once wherever they are in e4m3's normal range, and every value (earlier ones
    after the requantisations included) is within ``2**-4 |x| + 2**-9 s`` of what was written."""
    pages = [[2, 6, 4, 10], [11, 0, 8, 5]]
    n = 14
    k, v = _values(rng, n, loud=(5, 9)), _values(rng, n, loud=(2, 13))
    once = _write(create_kv_cache(_spec(), 12), k, v, _row_slots(pages, 0, n), [0, n])
    steps = create_kv_cache(_spec(), 12)
    cuts = [0, 3, 5, 6, 7, 9, 10, 11, 12, 13, 14]  # a prefill chunk ending mid-page, then one token at a time
    for a, b in zip(cuts[:-1], cuts[1:]):
        steps = _write(steps, k[a:b], v[a:b], _row_slots(pages, a, b - a), [0, b - a])
    grew = 0
    for role, x in (("key", k), ("value", v)):
        np.testing.assert_array_equal(np.asarray(steps[f"{role}_scale"]), np.asarray(once[f"{role}_scale"]))
        a = np.asarray(dequantize_pages(once[role], once[f"{role}_scale"]))
        s_ = np.asarray(dequantize_pages(steps[role], steps[f"{role}_scale"]))
        for h in range(2):
            for b, page in enumerate(pages[h]):
                block = x[4 * b: 4 * b + 4, h]
                s = float(once[f"{role}_scale"][page])
                grew += s > _np_scale(np.abs(block[:1]).max())
                normal = np.abs(block) >= 2.0 ** -6 * s
                np.testing.assert_array_equal(s_[page, : len(block)][normal], a[page, : len(block)][normal])
                for got in (a[page, : len(block)], s_[page, : len(block)]):
                    assert (np.abs(got - block) <= REL["fp8"] * np.abs(block) + SUB * s).all()
    assert grew >= 4  # the rule was exercised: pages whose first token's scale was raised later


def test_page_reused_from_offset_zero_forgets_old_scale(rng):
    """A page a previous owner filled with large values and a new owner writes from offset 0 with small ones
    takes the small values' scale (its old scale is not kept)."""
    cache = _write(create_kv_cache(_spec(), 4), 1e3 * _values(rng, 4), 1e3 * _values(rng, 4),
                   _row_slots([[1], [2]], 0, 4), [0, 4])
    k, v = 1e-3 * _values(rng, 3), 1e-3 * _values(rng, 3)
    out = _write(cache, k, v, _row_slots([[2], [1]], 0, 3), [0, 3])
    for role, x in (("key", k), ("value", v)):
        got = np.asarray(dequantize_pages(out[role], out[f"{role}_scale"]))
        for h, page in ((0, 2), (1, 1)):
            s = float(out[f"{role}_scale"][page])
            assert s == _np_scale(np.abs(x[:, h]).max())
            np.testing.assert_array_equal(got[page, :3], _np_quantise(x[:, h], s))


def test_mixed_batch_padding_and_skips(rng):
    """Rows of a ragged step (a prefill chunk, decode tokens continuing their pages, a padding row, skipped slots)
    each land in their own pages exactly as each row written alone."""
    pages = {0: [[0, 1], [2, 3]], 1: [[4, 5], [6, 7]], 2: [[8, 9], [10, 11]]}
    done = {0: 0, 1: 3, 2: 6}  # tokens each row has
    cache = create_kv_cache(_spec(), 12)
    hist = {r: (_values(rng, done[r]), _values(rng, done[r])) for r in pages}
    for r in pages:
        if done[r]:
            cache = _write(cache, *hist[r], _row_slots(pages[r], 0, done[r]), [0, done[r]])
    new = {0: 5, 1: 1, 2: 1}
    ks, vs, slots = [], [], []
    for r in pages:
        ks.append(_values(rng, new[r], loud=(0,) if r == 1 else ()))
        vs.append(_values(rng, new[r]))
        slots.append(_row_slots(pages[r], done[r], new[r]))
    pad_k = _values(rng, 2)
    k = np.concatenate(ks + [pad_k])
    v = np.concatenate(vs + [pad_k])
    sm = np.concatenate(slots + [np.full((2, 2), -1, np.int32)])
    cu = [0, 5, 5, 6, 7]  # row 1 of the batch is padding (length 0)
    order = [0, 1, 2]
    out = _write(cache, k, v, sm, cu)
    for r in order:
        alone = create_kv_cache(_spec(), 12)
        kk = np.concatenate([hist[r][0], ks[r]])
        vv = np.concatenate([hist[r][1], vs[r]])
        alone = _write(alone, kk, vv, _row_slots(pages[r], 0, len(kk)), [0, len(kk)])
        mine = sorted(p for hp in pages[r] for p in hp)
        for role in ("key", "value", "key_scale", "value_scale"):
            np.testing.assert_array_equal(np.asarray(out[role], np.float32)[mine],
                                          np.asarray(alone[role], np.float32)[mine])


# ------------------------------------------------------------------------------------------------ attention


def _paged_case(rng, dtype, *, rows=3, hkv=2, group=2, d=32, ps=8, lens=(37, 20, 9), new=(1, 4, 9)):
    """Random K/V of ``rows`` sequences written through the cache write into pages of ``dtype`` (fp8: with scales)
    on shuffled page tables; returns (q, cache, tables, seq_lens, cu, k_seq, v_seq)."""
    max_blocks = -(-max(lens) // ps)
    num_pages = rows * hkv * max_blocks + 3
    perm = rng.permutation(num_pages)
    tables = perm[: rows * hkv * max_blocks].reshape(rows, hkv, max_blocks).astype(np.int32)
    k_seq = [rng.standard_normal((n, hkv, d)).astype(np.float32) for n in lens]
    v_seq = [rng.standard_normal((n, hkv, d)).astype(np.float32) for n in lens]
    cache = create_kv_cache(GQACacheSpec(layer=0, num_kv_heads=hkv, page_size=ps, head_dim=d, dtype=dtype),
                            num_pages)
    for r, n in enumerate(lens):
        pos = np.arange(n)
        slots = (tables[r][:, pos // ps] * ps + pos % ps).T.astype(np.int32)
        cache = _write(cache, k_seq[r], v_seq[r], slots, [0, n])
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), hkv * group, d)).astype(np.float32)
    return q, cache, tables, np.asarray(lens, np.int32), cu, k_seq, v_seq


def _attend(q, cache, tables, seq_lens, cu, **kw):
    return np.asarray(paged_attention(jnp.asarray(q), cache["key"], cache["value"], jnp.asarray(tables),
                                      jnp.asarray(seq_lens), cu_seqlens=jnp.asarray(cu),
                                      k_scale=cache.get("key_scale"), v_scale=cache.get("value_scale"), **kw))


def test_fp8_reference_is_attention_over_dequantised_pages(rng):
    q, cache, tables, seq_lens, cu, _, _ = _paged_case(rng, FP8)
    got = _attend(q, cache, tables, seq_lens, cu, window=np.array([5, 0], np.int32), sinks=2)
    kd = np.asarray(dequantize_pages(cache["key"], cache["key_scale"]))
    vd = np.asarray(dequantize_pages(cache["value"], cache["value_scale"]))
    ps = cache["key"].shape[1]
    for r in range(len(seq_lens)):
        n = int(seq_lens[r])
        pos = np.arange(n)
        k = np.stack([kd[tables[r, h, pos // ps], pos % ps] for h in range(tables.shape[1])], axis=1)
        v = np.stack([vd[tables[r, h, pos // ps], pos % ps] for h in range(tables.shape[1])], axis=1)
        want = dense_attention_reference(jnp.asarray(q[cu[r]:cu[r + 1]]), jnp.asarray(k), jnp.asarray(v),
                                         window=np.array([5, 0], np.int32), sinks=2)
        np.testing.assert_allclose(got[cu[r]:cu[r + 1]], np.asarray(want), atol=2e-5, rtol=2e-5)


def _bound(q, k_seq, v_seq, cu, group, rel, sub_k, sub_v, scale):
    """A priori bound on ``|o_quantised - o_exact|`` per (token, query head) for full attention, from element
    errors ``|dk| <= rel |k| + sub_k`` and ``|dv| <= rel |v| + sub_v``: logit errors ``eps <= scale sum |q| |dk|``
    change each softmax weight by a factor within ``exp(+-2 eps)``, so the weights move by at most ``exp(2 eps) - 1``
    in total; plus the value error itself."""
    out = np.zeros(q.shape[:2])
    for r in range(len(k_seq)):
        n = k_seq[r].shape[0]
        for t in range(cu[r], cu[r + 1]):
            for hq in range(q.shape[1]):
                h = hq // group
                pos = n - (cu[r + 1] - t)  # this token's position
                k, v = k_seq[r][: pos + 1, h], v_seq[r][: pos + 1, h]
                eps = scale * (np.abs(q[t, hq]) * (rel * np.abs(k) + sub_k[r][h])).sum(-1).max()
                out[t, hq] = np.expm1(2 * eps) * np.abs(v).max() + rel * np.abs(v).max() + sub_v[r][h]
    return out


def test_fp8_pages_error_against_float_pages_is_bounded(rng):
    """Max error of attention outputs over fp8 pages against f32 pages and against bf16 pages, within the bound
    derived from e4m3's half-ulp 2**-4 (plus bf16's 2**-8 against bf16 pages)."""
    seed = int(rng.integers(1 << 30))
    group, d = 2, 32
    outs, cases = {}, {}
    for name, dtype in (("fp8", FP8), ("bf16", jnp.bfloat16), ("f32", jnp.float32)):
        cases[name] = _paged_case(np.random.default_rng(seed), dtype, group=group, d=d)
        outs[name] = _attend(*cases[name][:5])
    q, cache, tables, seq_lens, cu, k_seq, v_seq = cases["fp8"]
    ps = cache["key"].shape[1]
    sub = {}
    for role in ("key", "value"):  # 2**-9 s of each position's page, as one bound per (row, head): its max
        s = np.asarray(cache[f"{role}_scale"])
        sub[role] = [[SUB * s[tables[r, h, : -(-int(seq_lens[r]) // ps)]].max() for h in range(tables.shape[1])]
                     for r in range(len(seq_lens))]
    zero = [[0.0] * tables.shape[1] for _ in seq_lens]
    b8 = _bound(q, k_seq, v_seq, cu, group, REL["fp8"], sub["key"], sub["value"], d ** -0.5)
    b16 = _bound(q, k_seq, v_seq, cu, group, REL["bf16"], zero, zero, d ** -0.5)
    err32 = np.abs(outs["fp8"] - outs["f32"]).max(-1)
    err16 = np.abs(outs["fp8"] - outs["bf16"]).max(-1)
    assert (err32 <= b8).all(), (err32.max(), b8.min())
    assert (err16 <= b8 + b16).all()
    assert (np.abs(outs["bf16"] - outs["f32"]).max(-1) <= b16).all()
    assert err32.max() > 4 * np.abs(outs["bf16"] - outs["f32"]).max()  # fp8 is coarser than bf16 (measurably)


# ------------------------------------------------------------------------------------------------ kernels choice


def test_fp8_pages_choose_the_decode_and_mosaic_kernels():
    """On Hopper, fp8 decode goes to the split-KV kernel and fp8 prefill at pages of 64 to the Mosaic GPU kernel, as
    bf16 prefill does (the Triton prefill kernel could take it too); on a CPU auto takes the reference."""
    hopper = DeviceKind(platform="gpu", compute_capability="9.0", num_sms=132)
    cpu = DeviceKind(platform="cpu")
    for page in (16, 64):
        args, kwargs = TABLE.examples[f"decode B=64 L=4096 Hq=32 Hkv=8 D=128 page {page} fp8"]()
        assert TABLE.choose("auto", args, kwargs, device=hopper)[0] == "pallas"
        assert TABLE.choose("auto", args, kwargs, device=cpu)[0] == "reference"
        assert TABLE.choose("interpret", args, kwargs, device=cpu)[0] == "interpret"
    args, kwargs = TABLE.examples["prefill T=4096 H=32 D=128 page 64 fp8"]()
    reasons = dict(TABLE.explain(args, kwargs, device=hopper))
    assert reasons["mosaic"] is None and reasons["prefill"] is None
    assert TABLE.choose("auto", args, kwargs, device=hopper)[0] == "mosaic"
    assert TABLE.choose("auto", args, kwargs, device=cpu)[0] == "reference"
    bf16_args, bf16_kwargs = TABLE.examples["prefill T=4096 H=32 D=128 page 64 bf16"]()
    assert TABLE.choose("auto", bf16_args, bf16_kwargs, device=hopper)[0] == "mosaic"  # float pages: unchanged
    assert "k_scale" not in bf16_kwargs


# ------------------------------------------------------------------------------------------------ bad inputs


def test_bad_inputs_are_named(rng):
    q, cache, tables, seq_lens, cu, _, _ = _paged_case(rng, FP8)
    call = dict(cu_seqlens=jnp.asarray(cu))
    args = (jnp.asarray(q), cache["key"], cache["value"], jnp.asarray(tables), jnp.asarray(seq_lens))
    with pytest.raises(ValueError, match="fp8 pages need v_scale"):
        paged_attention(*args, k_scale=cache["key_scale"], **call)
    with pytest.raises(ValueError, match="k_scale must have shape"):
        paged_attention(*args, k_scale=cache["key_scale"][:-1], v_scale=cache["value_scale"], **call)
    with pytest.raises(ValueError, match="k_scale must have dtype"):
        paged_attention(*args, k_scale=cache["key_scale"].astype(jnp.bfloat16), v_scale=cache["value_scale"], **call)
    float_pages = cache["key"].astype(jnp.float32)
    with pytest.raises(ValueError, match="go with float8_e4m3fn pages"):
        paged_attention(args[0], float_pages, float_pages, *args[3:], k_scale=cache["key_scale"],
                        v_scale=cache["value_scale"], **call)
    with pytest.raises(ValueError, match="k_pages must have dtype"):
        paged_attention(args[0], cache["key"].astype(jnp.float8_e5m2), cache["value"], *args[3:],
                        k_scale=cache["key_scale"], v_scale=cache["value_scale"], **call)
    with pytest.raises(ValueError, match="v_pages must have shape"):
        paged_attention(args[0], cache["key"], cache["value"][:, :-1], *args[3:], k_scale=cache["key_scale"],
                        v_scale=cache["value_scale"], **call)
    k = jnp.asarray(rng.standard_normal((2, 2, cache["key"].shape[2])), jnp.float32)
    sm = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    cu2 = jnp.asarray([0, 2], jnp.int32)
    without = {r: cache[r] for r in ("key", "value", "key_scale")}
    with pytest.raises(ValueError, match=r"need roles \['value_scale'\]"):
        write_kv_cache(without, k, k, sm, cu_seqlens=cu2)
    with pytest.raises(ValueError, match="go with float8_e4m3fn pages"):
        check_gqa_cache({**cache, "key": float_pages, "value": float_pages})
    with pytest.raises(ValueError, match="value must have shape"):
        write_kv_fp8({**cache, "value": cache["value"][:-1]}, k, k, sm, cu2)
    with pytest.raises(ValueError, match="need cu_seqlens"):
        write_kv_cache(cache, k, k, sm)
