"""``kvjax.ops.draft.draft_steps``: the Triton-lowered kernel (interpret mode here, compiled on a GPU) against the
float32 reference on random layers (SWA head with sinks, holes, partial rotary, a dead row, a row running past its
table), the reference against the model's own layer loop, the table's choice, and bad calls named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.base.device import DeviceKind
from kvjax.ops import draft
from kvjax.pallas.draft import steps as kernel

H, I, V, HQ, HKV, D, PS, MB = 64, 128, 128, 4, 2, 16, 16, 5
NUM_PAGES = 80


def make_call(rng, *, steps=3, rotary=D, rows=4, dtype=np.float32):
    """A random layer and pages; row 0 ordinary, row 1 with a hole in its first KV head's table, row 2 running past
    its table (positions 77 ..), row 3 not live; KV head 1 a window of 24 with 4 sinks."""
    f = lambda *s, sc=1.0: jnp.asarray(rng.normal(0, sc, s).astype(dtype))  # noqa: E731
    lay = draft.DraftLayer(
        f(V, H), f(H, V, sc=H ** -.5), f(2 * H, H, sc=(2 * H) ** -.5), f(H, sc=.1), f(H, sc=.1), f(H, sc=.1),
        f(H, HQ * 2 * D, sc=H ** -.5), f(H, HKV * D, sc=H ** -.5), f(H, HKV * D, sc=H ** -.5), f(D, sc=.1), f(D, sc=.1),
        f(HQ * D, H, sc=(HQ * D) ** -.5), f(H, sc=.1), f(H, I, sc=H ** -.5), f(H, I, sc=H ** -.5),
        f(I, H, sc=I ** -.5), f(H, sc=.1))
    inv_freq = tuple(float(x) for x in 1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary))
    shape = draft.DraftShape(HQ, HKV, D, 1e-6, D ** -0.5, inv_freq)
    tables = rng.permutation(np.arange(1, NUM_PAGES))[:rows * HKV * MB].reshape(rows, HKV, MB).astype(np.int32)
    tables[1, 0, 1] = -1
    positions = np.array([40, 20, 76, 9][:rows], np.int32)
    live = np.array([True, True, True, False][:rows])
    return draft.DraftStepsCall(
        lay, f(NUM_PAGES, PS, D), f(NUM_PAGES, PS, D), f(rows, H), jnp.asarray(rng.integers(0, V, rows), jnp.int32),
        jnp.asarray(positions), jnp.asarray(live), jnp.asarray(tables), jnp.asarray([0, 24], jnp.int32),
        jnp.asarray([0, 4], jnp.int32), shape, steps)


def run(call, impl):
    return draft.draft_steps(call.layer, call.shape, *call[1:-2], steps=call.steps, impl=impl)


def written(call, steps):
    """bool[P, page_size]: the slots the steps write (live rows' positions p + 1 .. p + steps inside their tables,
    on heads whose block there is a page)."""
    out = np.zeros(call.k_pages.shape[:2], bool)
    tables = np.asarray(call.block_tables)
    for b, (p, live) in enumerate(zip(np.asarray(call.positions), np.asarray(call.live))):
        for pos in range(p + 1, p + steps + 1):
            if live and pos < MB * PS:
                for h in range(HKV):
                    page = tables[b, h, pos // PS]
                    if page >= 0:
                        out[page, pos % PS] = True
    return out


def check_against_reference(call, impl, tol):
    ref = run(call, "reference")
    got = run(call, impl)
    live = np.asarray(call.live)
    np.testing.assert_array_equal(np.asarray(got[0])[live], np.asarray(ref[0])[live])
    assert got[0].shape == (call.hidden.shape[0], call.steps) and got[0].dtype == jnp.int32
    for i in (1, 2):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(ref[i]), rtol=tol, atol=tol)
    mask = written(call, call.steps)
    for i, pages in ((1, call.k_pages), (2, call.v_pages)):  # exactly the slots the steps own changed
        changed = (np.asarray(ref[i]) != np.asarray(pages)).any(axis=2)
        np.testing.assert_array_equal(changed, mask)


@pytest.mark.parametrize("steps,rotary", [(3, D), (1, D), (5, D // 2)])
def test_kernel_matches_reference_interpret(rng, steps, rotary):
    """Drafts equal (live rows) and pages within 2e-5 (float32: the sums run in another order) of the reference;
    the only slots written are the live rows' own positions inside their tables."""
    check_against_reference(make_call(rng, steps=steps, rotary=rotary), "pallas:interpret", 2e-5)


def test_reference_drafts_follow_the_attention(rng):
    """The reference is not blind to its pages: new K/V values at a row's visible positions change its drafts."""
    call = make_call(rng, steps=3)
    base = np.asarray(run(call, "reference")[0])
    k2 = call.k_pages * 10.0 + 3.0
    other = np.asarray(run(call._replace(k_pages=k2, v_pages=-call.v_pages * 10.0), "reference")[0])
    assert (base[:3] != other[:3]).any()


def test_table_takes_the_kernel_for_small_float32_layers(rng):
    call = make_call(rng)
    gpu, cpu = DeviceKind("gpu", "9.0", 132), DeviceKind("cpu")
    assert draft.DRAFT_TABLE.choose("auto", (call,), {}, device=gpu)[0] == "pallas"
    assert draft.DRAFT_TABLE.choose("auto", (call,), {}, device=cpu)[0] == "reference"
    bf16 = make_call(rng, dtype=jnp.bfloat16)
    assert "float32" in kernel.unsupported(bf16)
    (big,), _ = draft.DRAFT_TABLE.examples["B=16 H=2048 Hq=16 Hkv=2 D=256 I=6144 V=4096"]()
    assert "power-of-two" in kernel.unsupported(big)
    assert "tiles of at most" in kernel.unsupported(big._replace(layer=big.layer._replace(
        gate_proj=jax.ShapeDtypeStruct((2048, 4096), jnp.float32), up_proj=jax.ShapeDtypeStruct((2048, 4096),
                                                                                              jnp.float32))))
    assert "at most 8 steps" in kernel.unsupported(call._replace(steps=9))


def test_kernel_lowers_for_cuda(rng):
    """The kernel lowers for a CUDA GPU on this host (Pallas -> Triton), at the spec toy's shape."""
    (call,), _ = draft.DRAFT_TABLE.examples["copy toy MTP B=16 H=64 Hq=4 Hkv=2 D=16 I=128 V=128, 3 steps"]()
    leaves, tree = jax.tree.flatten(tuple(call[:-2]))

    def fn(*leaves):
        return kernel.draft_steps_pallas(draft.DraftStepsCall(*jax.tree.unflatten(tree, leaves), call.shape,
                                                              call.steps))

    text = jax.jit(fn).trace(*leaves).lower(lowering_platforms=("cuda",)).as_text()
    assert "kvjax_draft_steps_s3" in text


@pytest.mark.parametrize("change,match", [
    (lambda c: c._replace(steps=0), "steps must be a positive int"),
    (lambda c: c._replace(shape="x"), "shape must be a DraftShape"),
    (lambda c: c._replace(layer=c.layer._replace(fc=c.layer.fc[:-1])), "layer.fc"),
    (lambda c: c._replace(tokens=c.tokens.astype(jnp.float32)), "tokens"),
    (lambda c: c._replace(block_tables=c.block_tables[:, :1]), "block_tables"),
    (lambda c: c._replace(v_pages=c.v_pages[:-1]), "v_pages"),
])
def test_bad_calls_are_named(rng, change, match):
    with pytest.raises(ValueError, match=match):
        run(change(make_call(rng)), "reference")


def test_draft_shape_is_validated():
    with pytest.raises(ValueError, match="multiple"):
        draft.DraftShape(3, 2, 16, 1e-6, 0.25, (1.0,))
    with pytest.raises(ValueError, match="inv_freq"):
        draft.DraftShape(4, 2, 16, 1e-6, 0.25, tuple([1.0] * 9))


@pytest.mark.gpu
@pytest.mark.parametrize("steps,rotary", [(3, D), (7, D // 2)])
def test_kernel_matches_reference_gpu(rng, steps, rotary):
    """The compiled kernel against the reference (both on the GPU)."""
    check_against_reference(make_call(rng, steps=steps, rotary=rotary), "pallas", 5e-5)
