"""Issue 36: the two GDN rollbacks of speculative decoding, one GDN layer's verification work side by side.

- **step buffer** (SGLang's; what the engine does, :mod:`kvjax.state.gdn_spec`): the verification kernel writes the
  state after every position into a step buffer ``f32[L, B, K+1, Hv, K, V]`` and the state after the last token into
  the row's slot; after sampling, ``commit`` gathers each row's accepted state from the buffer and scatters it into
  the slot. ``+ zeroed buffer``: a single verification step's buffer is zero-filled first (a verification burst
  carries it between sub-steps instead).
- **pool slots** (vLLM's): the same kernel with ``position_slots``: each position's state goes to a pool slot of
  its own (``K + 1`` slots per request); the accepted one becomes the row's state by index, no copy.

Bytes moved per row and value head (state ``K x V`` f32 = s): buffer ``(1 + (K+1) + 1) s`` by the kernel plus
``2 s`` by the commit; pool slots ``(1 + (K+1)) s``. Device time (profiler) of each at rows x value heads, all rows
verifying ``K + 1`` tokens, acceptance random; the XLA copy of the same run gives the copy rate.

    python benchmarks/rollback.py [--json OUT] [--shapes 16x32,64x32]
    python benchmarks/rollback.py --interpret --shapes 2x2 --copy-bytes 1048576   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = ((1, 32), (16, 32), (64, 32), (64, 16))  # (rows, value heads); Hk = Hv / 2, K = V = 128
DRAFTS = 4  # K: K + 1 = 5 positions a row


def _case(rows: int, hv: int, J: int, seed: int = 0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    hk, d = hv // 2, 128
    T = rows * J
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k = f(T, hk, d).astype(jnp.bfloat16), f(T, hk, d).astype(jnp.bfloat16)
    v = f(T, hv, d).astype(jnp.bfloat16)
    g, beta = -jnp.abs(f(T, hv)) * 0.1, jax.nn.sigmoid(f(T, hv)).astype(jnp.bfloat16)
    cu = jnp.arange(rows + 1, dtype=jnp.int32) * J
    num_slots = rows * (J + 1) + 1
    slots = jnp.arange(1, rows + 1, dtype=jnp.int32)  # each row's state
    position_slots = (rows + 1 + jnp.arange(rows * J, dtype=jnp.int32)).reshape(rows, J)  # vLLM: K + 1 more each
    accepted = jnp.asarray(rng.integers(0, J, rows), jnp.int32)
    ssm = 0.1 * f(1, num_slots, hv, d, d)
    return (q, k, v, g, beta, cu, slots, position_slots, accepted), ssm


def runners(rows: int, hv: int, J: int, interpret: bool = False) -> tuple[dict, int]:
    """The three variants as timer runners (state threaded through: the kernel donates it) and the state bytes."""
    import jax
    import jax.numpy as jnp

    from kvjax.pallas.gdn.verify import verify_slots

    (q, k, v, g, beta, cu, slots, pos, acc), ssm = _case(rows, hv, J)
    kw = dict(cu_seqlens=cu, slot_ids=slots, layer=0, scale=128 ** -0.5, use_qk_l2norm=True, interpret=interpret)
    rows_ix = jnp.arange(rows)

    def buffer(ssm, states):
        o, ssm, states = verify_slots(q, k, v, g, beta, ssm, states, **kw)
        return o, ssm.at[0, slots].set(states[0, rows_ix, acc]), states

    buffer = jax.jit(buffer, donate_argnums=(0, 1))
    zeroed = jax.jit(lambda ssm, states: buffer(ssm, jnp.zeros_like(states)), donate_argnums=(0, 1))
    to_slots = jax.jit(lambda ssm: verify_slots(q, k, v, g, beta, ssm, None, position_slots=pos, **kw)[:2],
                       donate_argnums=(0,))
    state = {"buffer": [ssm, jnp.zeros((1, rows, J, hv, 128, 128), jnp.float32)],
             "zeroed": [jnp.array(ssm, copy=True), jnp.zeros((1, rows, J, hv, 128, 128), jnp.float32)],
             "slots": [jnp.array(ssm, copy=True)]}

    def run_buffer(name, fn):
        def run():
            o, state[name][0], state[name][1] = fn(*state[name])
            return o
        return run

    def run_slots():
        o, state["slots"][0] = to_slots(*state["slots"])
        return o

    s = hv * 128 * 128 * 4  # one row's state, every value head
    return {"step buffer": run_buffer("buffer", buffer), "step buffer + zeroed buffer": run_buffer("zeroed", zeroed),
            "pool slots": run_slots}, s


def main(argv=None) -> dict:
    """Time the variants at :data:`SHAPES`; print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=None, help="rows x value heads, e.g. 16x32,64x32")
    ap.add_argument("--interpret", action="store_true", help="the kernel in interpret mode (a CPU smoke run)")
    ap.add_argument("--copy-bytes", type=int, default=1 << 30, help="bytes of the copy-rate measurement")
    args = ap.parse_args(argv)
    shapes = SHAPES if not args.shapes else tuple(tuple(map(int, s.split("x"))) for s in args.shapes.split(","))
    import jax

    from timing import interleaved, xla_copy

    J = DRAFTS + 1
    copy = xla_copy(args.copy_bytes)
    rate = copy["bytes"] / (copy["device_ms"] or copy["wall_ms"]) / 1e6  # GB/s
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; K = {DRAFTS}; copy rate {rate:.0f} GB/s")
    print("\n| rows | Hv | variant | device ms | wall ms | state bytes moved (MB) | vs copy rate | vs step buffer |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    out = []
    for rows, hv in shapes:
        fns, s = runners(rows, hv, J, args.interpret)
        moved = {"step buffer": (J + 4) * s * rows, "step buffer + zeroed buffer": (2 * J + 4) * s * rows,
                 "pool slots": (J + 1) * s * rows}
        t = interleaved(fns, rounds=3, n=2 if args.interpret else 20)
        base = t["step buffer"]["device_ms"] or t["step buffer"]["wall_ms"]
        for name, r in t.items():
            ms = r["device_ms"] or r["wall_ms"]
            floor = moved[name] / rate / 1e6
            row = dict(rows=rows, hv=hv, variant=name, device_ms=r["device_ms"], wall_ms=r["wall_ms"],
                       bytes=moved[name], vs_copy=floor / ms, vs_buffer=base / ms)
            out.append(row)
            dev = f"{r['device_ms']:.4f}" if r["device_ms"] is not None else "-"
            print(f"| {rows} | {hv} | {name} | {dev} | {r['wall_ms']:.4f} | {moved[name] / 1e6:.1f} | "
                  f"{floor / ms:.0%} | {base / ms:.2f}x |", flush=True)
    report = dict(copy=copy, drafts=DRAFTS, rows=out)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1, default=float)
    return report


if __name__ == "__main__":
    main()
