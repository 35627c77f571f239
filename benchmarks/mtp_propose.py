"""Issue 36: one MTP propose on the device, kernel by kernel (the MTP layer's share of a verification sub-step).

One call of :func:`kvjax.models.qwen3_5.mtp.mtp_propose` at the shapes a verification burst of
``benchmarks/spec.py`` runs it: the copy toy's MTP layer (hidden 64, 4 query / 2 KV heads of 16, vocabulary 128;
untrained: the kernels do not depend on the weights), ``--rows`` rows each verifying ``K + 1`` tokens at a context of
``--context`` tokens, pages of 16; then the catch-up over the ``B (K + 1)`` tokens and the ``K - 1`` one-token draft
steps. Timed as a ``lax.scan`` of 32 proposes (the pages carried, as in a burst) and one traced pass of three such
scans: kernels per propose with their device time, by name (``--order``: also one propose's kernels in launch order).

    python benchmarks/mtp_propose.py [--rows 16] [--drafts 4] [--context 160] [--path op|loop] [--out DIR]
    python benchmarks/mtp_propose.py --rows 2 --scan 2   # CPU smoke (no device records: times only)
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PAGE = 16
TABLE_TOKENS = 224  # the spec toy's served length (prompt 64 + 128 new + drafts), the block tables' width


def build(rows: int, drafts: int, context: int, seed: int = 0, path: str = "op"):
    """``(propose, args)``: the jitted propose and its arguments (model / MTP states, random pages and hidden states,
    a verification step's inputs of ``rows`` rows at ``context`` tokens). ``path``: the one-token draft steps as the
    op (``"op"``, :func:`kvjax.models.qwen3_5.mtp.draft_op`: its backend table's choice) or as the layer's own
    steps (``"loop"``, :func:`~kvjax.models.qwen3_5.mtp.draft_loop`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import kvjax.models.interface  # noqa: F401  (registers StepInputs as a pytree)
    from kvjax.experiments import spec_runs
    from kvjax.inputs import StepInputs
    from kvjax.models.qwen3_5 import mtp as mtp_lib

    if path not in ("op", "loop"):
        raise ValueError(f"path must be 'op' or 'loop', got {path!r}")
    if not 0 < drafts + 1 <= context <= TABLE_TOKENS:
        raise ValueError(f"need 0 < drafts + 1 <= context <= {TABLE_TOKENS}, got drafts={drafts}, context={context}")
    task = spec_runs.CopyTask(vocab=128, length=TABLE_TOKENS, min_period=4, max_period=8)
    model = spec_runs.copy_model(task, hidden=64, layer_types=("full_attention", "full_attention"))
    head, _ = spec_runs.copy_mtp(model, task, steps=0)
    model = spec_runs.attach_mtp(spec_runs.with_idle_layers(model, ("linear_attention",)), head)
    head = mtp_lib.mtp_of(model)
    hkv, hidden = model.config.attention.num_kv_heads, model.config.hidden_size
    blocks = TABLE_TOKENS // PAGE
    rng = np.random.default_rng(seed)
    pages = {n: jnp.asarray(rng.normal(size=p.shape).astype(np.float32))  # [P, PAGE, D] each
             for n, p in head.init_caches(num_pages=rows * hkv * blocks + 1, page_size=PAGE).items()}
    tables = (1 + np.arange(rows * hkv * blocks)).reshape(rows, hkv, blocks).astype(np.int32)  # i32[B, Hkv, blocks]
    j = drafts + 1
    seq = np.full(rows, context, np.int32)  # i32[B]
    pos = (seq[:, None] - j + np.arange(j)[None]).reshape(-1).astype(np.int32)  # i32[T]
    row = np.repeat(np.arange(rows), j)
    slots = tables[row, :, pos // PAGE] * PAGE + (pos % PAGE)[:, None]  # i32[T, Hkv]
    inputs = StepInputs(
        token_ids=jnp.asarray(rng.integers(0, task.vocab, rows * j).astype(np.int32)), positions=jnp.asarray(pos),
        cu_seqlens=jnp.asarray((np.arange(rows + 1) * j).astype(np.int32)), seq_lens=jnp.asarray(seq),
        gdn_slots=jnp.asarray(np.arange(1, rows + 1).astype(np.int32)), has_initial_state=jnp.ones(rows, bool),
        block_tables=jnp.asarray(tables), slot_mapping=jnp.asarray(slots.astype(np.int32)),
        logits_indices=jnp.asarray((np.arange(rows) * j + j - 1).astype(np.int32)), max_query_len=j)
    states = jnp.asarray(rng.normal(size=(rows * j, hidden)).astype(np.float32))  # [T, H]: the model's hidden states
    sampled = jnp.asarray(rng.integers(0, task.vocab, rows).astype(np.int32))  # i32[B]
    mdef, mstate = nnx.split(model)
    hdef, hstate = nnx.split(head)

    def propose(mstate, hstate, pages, states, inputs, sampled):
        layers = nnx.merge(hdef, hstate)
        op = mtp_lib.draft_op
        if path == "loop":  # traced with the layer's own steps in the op's place
            mtp_lib.draft_op = mtp_lib.draft_loop
        try:
            return layers.propose(nnx.merge(mdef, mstate), pages, states, inputs, sampled, num_draft=drafts)
        finally:
            mtp_lib.draft_op = op

    return jax.jit(propose), (mstate, hstate, pages, states, inputs, sampled)


def scanned(propose, n: int):
    """``n`` proposes in a ``lax.scan`` with the pages carried (jitted): ``(args) -> (pages, drafts i32[n, B, K])``."""
    import jax

    def run(mstate, hstate, pages, states, inputs, sampled):
        def body(carry, _):
            drafts, carry = propose(mstate, hstate, carry, states, inputs, sampled)
            return carry, drafts
        return jax.lax.scan(body, pages, None, length=n)

    return jax.jit(run)


def device_records(trace_dir: str) -> list[tuple[int, int, str]]:
    """``(start ns, duration ns, name)`` of every kernel record on the GPU planes of the latest trace, by start."""
    import jax

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = jax.profiler.ProfileData.from_file(max(paths))
    return sorted((e.start_ns, e.duration_ns, e.name) for p in data.planes if p.name.startswith("/device:GPU")
                  for line in p.lines if line.name.startswith("Stream") for e in line.events)


def main(argv=None) -> dict:
    import jax
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--drafts", type=int, default=4, help="K: the catch-up over K + 1 tokens a row, K - 1 steps")
    ap.add_argument("--context", type=int, default=160, help="each row's context, its K + 1 tokens included")
    ap.add_argument("--scan", type=int, default=32, help="proposes per timed scan")
    ap.add_argument("--out", default=None, help="a folder for the trace and the compiled HLO (default: temporary)")
    ap.add_argument("--order", action="store_true", help="also one propose's kernels in launch order")
    ap.add_argument("--path", default="op", choices=("op", "loop"),
                    help="the draft steps as the op (its table's kernel) or as the layer's own steps")
    args = ap.parse_args(argv)
    propose, call = build(args.rows, args.drafts, args.context, path=args.path)
    loop = scanned(propose, args.scan)
    out = args.out or tempfile.mkdtemp(prefix="mtp_propose_")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "propose_hlo.txt"), "w") as f:
        f.write(propose.lower(*call).compile().as_text())
    jax.block_until_ready(loop(*call))
    walls = []
    for _ in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*call))
        walls.append(time.perf_counter() - t0)
    per = float(np.median(walls)) / args.scan
    print(f"{args.rows} rows, K = {args.drafts}, context {args.context}, draft steps as the {args.path}: "
          f"{per * 1e6:.1f} us a propose (wall, median "
          f"of 20 scans of {args.scan})")
    result = dict(rows=args.rows, drafts=args.drafts, context=args.context, path=args.path, wall_us=per * 1e6)
    trace = os.path.join(out, "trace")
    jax.profiler.start_trace(trace)
    for _ in range(3):
        jax.block_until_ready(loop(*call))
    jax.profiler.stop_trace()
    recs = device_records(trace) if jax.default_backend() == "gpu" else []
    if not recs:
        print("no device records (not a GPU run)")
        return result
    n = 3 * args.scan
    names: dict[str, list] = {}
    for _, dur, name in recs:
        names.setdefault(name, []).append(dur)
    result.update(kernels=len(recs) / n, kernel_us=sum(d for _, d, _ in recs) / n / 1e3)
    print(f"{result['kernels']:.1f} kernels a propose, {result['kernel_us']:.1f} us of kernel time (traced)")
    print("| kernel | records a propose | us a propose |\n|---|---:|---:|")
    for name, durs in sorted(names.items(), key=lambda kv: -sum(kv[1])):
        print(f"| `{name[:80]}` | {len(durs) / n:.2f} | {sum(durs) / n / 1e3:.2f} |")
    if args.order:
        mid = len(recs) // 2
        print("one propose in launch order (gap to the previous end us, duration us, name):")
        for (s0, d0, _), (s1, d1, name) in zip(recs[mid - 1:], recs[mid:mid + int(result["kernels"]) + 1]):
            print(f"{(s1 - s0 - d0) / 1e3:7.2f} {d1 / 1e3:7.2f} {name[:100]}")
    return result


if __name__ == "__main__":
    main()
