"""Shared memory and registers of every Triton kernel the backend tables can take, compiled for sm_90 on any host.

Usage (repo root; needs ``pip install triton==3.6.0``, the version of the device machine, no GPU)::

    python benchmarks/triton_resources.py [--ops gdn_chunk,paged_attention] [--json OUT.json]

For every op's backend table (``kvjax.ops.tables()``), every example call of the table and every backend that can
take it by name on an H100 (``NAMED["h100"]``), the call is lowered for CUDA (``lowering_platforms=("cuda",)``,
which builds the GPU lowering on any host), each Pallas Triton kernel of the lowering is captured with its
``num_warps`` / ``num_stages`` and compiled by the installed Triton for ``sm_90``; ``ptxas -v`` (shipped with
Triton) gives its registers and spills. A kernel whose shared memory passes a Hopper CTA's 227 KB
(:data:`HOPPER_SMEM`) fails to launch on the GPU: such lines are marked ``OVER``; the exit status is 1 for any
``OVER`` line or any kernel that does not lower or compile.

XLA's own Triton (the one jax 0.11's GPU plugin embeds) may allocate a little differently from the pip wheel; the
figures are a check to run before a GPU call, not a measurement. Mosaic GPU kernels are not covered (their shared
memory is the kernels' own ``smem_bytes`` checks).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

HOPPER_SMEM = 227 * 1024  # bytes of shared memory a CTA may take on sm_90 (232448)


def capture_kernels(fn, args, kwargs) -> list[dict]:
    """Lower ``fn(*args, **kwargs)`` for CUDA and return each Pallas Triton kernel of it: ``name``, ``ttir`` (the
    module's text), ``num_warps``, ``num_stages``."""
    import jax
    from jax._src.pallas import core as pallas_core
    from jax._src.pallas.triton import core as triton_core
    from jax._src.pallas.triton import pallas_call_registration as reg

    found: list[dict] = []
    original = reg.pallas_call_lowering
    lower_module = reg.lowering.lower_jaxpr_to_triton_module

    def rule(ctx, *nodes, compiler_params=None, **params):
        p = compiler_params or triton_core.CompilerParams()
        found.append({"num_warps": 4 if p.num_warps is None else p.num_warps,
                      "num_stages": 3 if p.num_stages is None else p.num_stages})
        return original(ctx, *nodes, compiler_params=compiler_params, **params)

    def module(*a, **k):
        result = lower_module(*a, **k)
        text = result.module.operation.get_asm(enable_debug_info=False)
        found[-1].update(ttir=text, name=re.search(r"tt.func public @(\w+)", text).group(1))
        return result

    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    traced = [i for i, x in enumerate(leaves) if isinstance(x, (jax.ShapeDtypeStruct, jax.Array))]

    def call(*arrays):  # the example's arrays traced; its scalars, shapes and flags as the call gives them
        values = list(leaves)
        for i, x in zip(traced, arrays):
            values[i] = x
        a, k = jax.tree_util.tree_unflatten(tree, values)
        return fn(*a, **k)

    pallas_core.register_lowering_rule(triton_core.CompilerParams, rule, "gpu")
    reg.lowering.lower_jaxpr_to_triton_module = module
    try:
        jax.jit(call).trace(*[leaves[i] for i in traced]).lower(lowering_platforms=("cuda",))
    finally:
        pallas_core.register_lowering_rule(triton_core.CompilerParams, original, "gpu")
        reg.lowering.lower_jaxpr_to_triton_module = lower_module
    return [k for k in found if "ttir" in k]


def compile_sm90(kernel: dict, work: str) -> dict:
    """Compile one captured kernel with the installed Triton for sm_90: shared bytes, registers, spill bytes."""
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(work, f"{kernel['name']}.ttir")
    with open(path, "w") as f:
        f.write(kernel["ttir"])
    compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"]})
    ptx = path + ".ptx"
    with open(ptx, "w") as f:
        f.write(compiled.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull], capture_output=True,
                         text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"shared": int(compiled.metadata.shared), "registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else None}


def audit(ops_wanted: set[str] | None = None) -> list[dict]:
    """Every (table, example, backend by name) of the tables: its Triton kernels' resources, or why it was not
    compiled (the backend declines the call; a lowering or compile error)."""
    from kvjax import ops
    from kvjax.base.device import NAMED
    from kvjax.errors import UnknownImplError

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for table in ops.tables():
            if ops_wanted and table.op not in ops_wanted:
                continue
            for example, make in table.examples.items():
                args, kwargs = make()
                for backend in table.backends:
                    row = {"op": table.op, "example": example, "backend": backend.name}
                    try:
                        _, fn = table.choose(backend.name, args, kwargs, NAMED["h100"])
                    except UnknownImplError:
                        continue  # this backend does not take this example (info says why)
                    try:
                        kernels = capture_kernels(fn, args, kwargs)
                    except NameError as e:  # a collective kernel: it lowers only under shard_map (no Triton in it)
                        if "unbound axis name" not in str(e):
                            raise
                        continue
                    except Exception as e:  # noqa: BLE001 - a lowering that fails is a finding, said as such
                        rows.append(dict(row, error=f"lowering: {type(e).__name__}: {str(e)[:300]}"))
                        print(rows[-1], flush=True)
                        continue
                    for kernel in kernels:
                        out = dict(row, kernel=kernel["name"], num_warps=kernel["num_warps"],
                                   num_stages=kernel["num_stages"])
                        try:
                            out.update(compile_sm90(kernel, work))
                            out["over"] = out["shared"] > HOPPER_SMEM
                        except Exception as e:  # noqa: BLE001
                            out["error"] = f"compile: {type(e).__name__}: {str(e)[:300]}"
                        rows.append(out)
                        flag = "OVER" if out.get("over") else ("ERROR" if "error" in out else "ok")
                        print(f"{flag:>5} {table.op:>24} {backend.name:>12} {kernel['name']:>28} "
                              f"shared {out.get('shared', '-'):>7} regs {out.get('registers', '-')} "
                              f"spills {out.get('spill_stores', '-')}  [{example}]", flush=True)
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", help="comma list of op names (default: every table's)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        ap.error("needs Triton: pip install triton==3.6.0 (no GPU needed)")
    from kvjax import ops

    wanted = {o.strip() for o in a.ops.split(",") if o.strip()} if a.ops else None
    unknown = sorted((wanted or set()) - {t.op for t in ops.tables()})
    if unknown:
        ap.error(f"unknown op {unknown[0]!r}; ops: {', '.join(t.op for t in ops.tables())}")
    rows = audit(wanted)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    over = [r for r in rows if r.get("over")]
    errors = [r for r in rows if "error" in r]
    print(f"{len(rows)} kernels: {len(over)} over {HOPPER_SMEM} bytes of shared memory, {len(errors)} errors")
    return 1 if over or errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
