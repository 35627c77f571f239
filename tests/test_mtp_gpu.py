"""The MTP drafter on a GPU (issue 36): the paged MTP step and ``mtp_propose`` through the paged-attention
kernels (``impl="auto"``: the prefill kernel for the catch-up, the decode kernel for the draft steps) against the
full-sequence MTP, at kernel-sized shapes (head_dim 128, pages of 16); and, run as a script, the drafter's cost
beside the main model's verification step.

    python -m pytest -q -m gpu tests/test_mtp_gpu.py      # correctness (skipped without a GPU)
    python tests/test_mtp_gpu.py [--rows 1,16,64] [--ks 1,2,4] [--context 512]   # timing table (GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.config import AttentionConfig, GDNConfig
from kvjax.inputs import StepInputs
from kvjax.models.common.checkpoint import assign_params
from kvjax.models.qwen3_5 import Qwen3_5Config, init_random, init_random_on_device
from kvjax.models.qwen3_5 import mtp as mtp_lib

PAGE = 16


def gpu_config(hidden: int = 256, layers=("linear_attention", "full_attention"), vocab: int = 512) -> Qwen3_5Config:
    return Qwen3_5Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, layer_types=tuple(layers),
        attention=AttentionConfig(8, 2, 128), gdn=GDNConfig(4, 8, 128, 128, 4),
        rope_theta=10_000_000.0, partial_rotary_factor=0.25,
    )


def row_inputs(rng, lens, new, *, pages_per_row: int, decode_only: bool = False) -> StepInputs:
    """Rows of ``new[b]`` new tokens after ``lens[b]`` computed ones, each row's pages a shuffled, disjoint set of
    ``pages_per_row`` per KV head (2 heads), enough for every draft position."""
    b, hkv = len(lens), 2
    perm = rng.permutation(b * hkv * pages_per_row).reshape(b, hkv, pages_per_row).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    pos = np.concatenate([np.arange(l, l + n) for l, n in zip(lens, new)]).astype(np.int32)
    row = np.repeat(np.arange(b), new)
    smap = perm[row, :, pos // PAGE] * PAGE + (pos % PAGE)[:, None]
    return StepInputs.from_numpy(
        decode_only=decode_only, token_ids=rng.integers(0, 512, len(pos)), positions=pos, cu_seqlens=cu,
        seq_lens=np.asarray(lens) + np.asarray(new), gdn_slots=np.arange(1, b + 1),
        has_initial_state=np.asarray(lens) > 0, block_tables=perm, slot_mapping=smap, logits_indices=cu[1:] - 1,
    )


@pytest.mark.gpu
def test_gpu_propose_through_kernels_matches_full_sequence_mtp(rng):
    cfg = gpu_config()
    model = init_random(cfg, seed=1)
    mtp = mtp_lib.init(cfg, seed=2)
    r = np.random.default_rng(3)  # norm scales away from their init (0: scale 1)
    mtp = assign_params(mtp, {p: 0.3 * r.standard_normal(v.get_value().shape) if v.get_value().ndim == 1
                              else v.get_value() for p, v in nnx.to_flat_state(nnx.state(mtp))})
    lens = [0, 0, 0, 0]
    prompts = [rng.integers(0, 512, n).astype(np.int32) for n in (70, 33, 129, 17)]
    k = 4
    inputs = row_inputs(rng, lens, [len(p) for p in prompts], pages_per_row=12)
    inputs = StepInputs(**{**vars(inputs), "token_ids": np.concatenate(prompts)})
    caches = model.init_caches(num_pages=4 * 2 * 12, page_size=PAGE, max_seqs=4)
    pages = mtp_lib.init_mtp_caches(mtp, num_pages=4 * 2 * 12, page_size=PAGE)
    _, h, caches = nnx.jit(lambda m, c, i: m.forward_step_hidden(c, i))(model, caches, inputs)
    follow = rng.integers(0, 512, 4).astype(np.int32)
    drafts, pages = nnx.jit(lambda m, t, p, h, i, s: mtp_lib.mtp_propose(m, t, p, h, i, s, num_draft=k))(
        model, mtp, pages, h, inputs, jnp.asarray(follow))
    drafts = np.asarray(drafts)
    dense = nnx.jit(lambda m, t, h, ids: t.dense(m, h, ids))
    full = nnx.jit(lambda m, ids: m.hidden_states(ids))
    for b, p in enumerate(prompts):
        n = len(p)
        hid = np.zeros((1, 160, cfg.hidden_size), np.float32)
        nxt = np.zeros((1, 160), np.int32)
        hid[0, :n] = np.asarray(full(model, jnp.asarray(np.resize(p, 160)[None])))[0, :n]
        # float32 products take TF32 on a GPU in both paths (the kernels' and XLA's dots; unit roundoff 2^-11 ~
        # 4.9e-4): hidden states of O(1) after two layers agree to a few of those
        np.testing.assert_allclose(np.asarray(h)[inputs.cu_seqlens[b]:inputs.cu_seqlens[b + 1]], hid[0, :n],
                                   atol=3e-3, rtol=0)
        nxt[0, :n] = np.append(p[1:], follow[b])
        want = []
        for i in range(n - 1, n - 1 + k):
            g = np.asarray(dense(model, mtp, jnp.asarray(hid), jnp.asarray(nxt)))[0, i]
            want.append(int(np.argmax(np.asarray(mtp.logits(model, jnp.asarray(g))))))
            hid[0, i + 1], nxt[0, i + 1] = g, want[-1]
        assert drafts[b].tolist() == want, b


def _time(fn, state, reps: int = 20):
    """Median seconds of ``fn(state) -> (out, state)`` (the state donated and threaded through), after a warm-up;
    returns (seconds, last out, state)."""
    out, state = fn(state)
    jax.block_until_ready((out, state))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out, state = fn(state)
        jax.block_until_ready((out, state))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out, state


def _split3(out):  # (logits, hidden, caches) -> (hidden, caches)
    return out[1], out[2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args(argv)
    layers = ("linear_attention",) * 3 + ("full_attention",)
    cfg = gpu_config(args.hidden, layers * 2, vocab=args.vocab)
    model = init_random_on_device(cfg, seed=0, dtype=jnp.bfloat16)
    mtp = mtp_lib.init(cfg, seed=1, dtype=jnp.bfloat16)
    graphdef, params = nnx.split(model)
    mdef, mparams = nnx.split(mtp)
    print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; main model {len(cfg.layer_types)} layers "
          f"(hidden {cfg.hidden_size}, 8 q / 2 KV heads of 128, vocab {cfg.vocab_size}), bf16; one MTP layer; "
          f"context {args.context}, pages of {PAGE}; medians of 20 after a warm-up")
    print(f"{'rows':>5} {'K':>3} {'main verify ms':>15} {'main decode ms':>15} {'mtp propose ms':>15} "
          f"{'propose/verify':>15}")

    def verify_fn(p, c, i):
        return nnx.merge(graphdef, p).forward_step_hidden(c, i)

    def propose_fn(p, mp, pages, h, i, s, k):
        return mtp_lib.mtp_propose(nnx.merge(graphdef, p), nnx.merge(mdef, mp), pages, h, i, s, num_draft=k)

    verify = jax.jit(verify_fn, donate_argnums=(1,))
    propose = jax.jit(propose_fn, donate_argnums=(2,), static_argnums=(6,))
    rng = np.random.default_rng(0)
    for rows in [int(x) for x in args.rows.split(",")]:
        for k in [int(x) for x in args.ks.split(",")]:
            per_row = -(-(args.context + 2 * k + 2) // PAGE)
            num_pages = rows * 2 * per_row
            caches = model.init_caches(num_pages=num_pages, page_size=PAGE, max_seqs=rows, dtype=jnp.bfloat16)
            pages = mtp_lib.init_mtp_caches(mtp, num_pages=num_pages, page_size=PAGE, dtype=jnp.bfloat16)
            lens = [args.context] * rows
            vin = jax.device_put(row_inputs(rng, lens, [k + 1] * rows, pages_per_row=per_row))
            din = jax.device_put(row_inputs(rng, lens, [1] * rows, pages_per_row=per_row, decode_only=True))
            t_verify, h, caches = _time(lambda c: _split3(verify(params, c, vin)), caches)
            t_decode, _, caches = _time(lambda c: _split3(verify(params, c, din)), caches)
            sampled = jnp.zeros(rows, jnp.int32)
            t_prop, _, pages = _time(lambda pg: propose(params, mparams, pg, h, vin, sampled, k), pages)
            print(f"{rows:>5} {k:>3} {1e3 * t_verify:>15.3f} {1e3 * t_decode:>15.3f} {1e3 * t_prop:>15.3f} "
                  f"{t_prop / t_verify:>15.2f}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
