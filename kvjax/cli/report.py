"""What ``python -m kvjax run`` prints and writes: the table of its runs, per-device page use on a mesh, a digest
of the generated tokens, and the ``--plot`` figure (with the check that it can be written).
"""

from __future__ import annotations

import hashlib
import json
import os

import jax

from kvjax.errors import UsageError


def format_table(results: dict[str, dict], per_device: bool = False) -> str:
    """Fixed-width table, one line per policy, of ``{policy: run_policy summary}``: tokens/s is the median over the
    repeats, with their range beside it. ``per_device`` (a mesh): also tokens/s per device and the range over
    the devices of each one's peak page use (fraction of its pool; ``-`` where the engine did not record it)."""
    head = (f"{'recycle':18} {'tok/s':>9} {'tok/s range':>17} {'tok/step':>8} {'steps':>6} {'run mean':>8} "
            f"{'run peak':>8} {'preempt':>7} {'util mean':>9} {'util peak':>9} {'host %':>6} {'compile s':>9}"
            + (f" {'tok/s/dev':>9} {'dev util peak':>13}" if per_device else ""))
    lines = [head, "-" * len(head)]
    for name, s in results.items():
        rates = s.get("generated_tokens_per_s_repeats") or [s["generated_tokens_per_s"]]
        spread = f"{min(rates):.1f}-{max(rates):.1f}"
        lines.append(f"{name:18} {s['generated_tokens_per_s']:9.1f} {spread:>17} {s['generated_tokens_per_step']:8.2f} "
                     f"{s['steps']:6d} {s['running_mean']:8.2f} {s['running_peak']:8d} {s['preemptions']:7d} "
                     f"{s['page_util_mean']:9.3f} {s['page_util_peak']:9.3f} {100 * s['host_share']:6.1f} "
                     f"{s['compile_time_s']:9.1f}" + (_device_columns(s) if per_device else ""))
    return "\n".join(lines)


def _device_columns(s: dict) -> str:
    peaks = s.get("page_util_device_peak")
    spread = f"{min(peaks):.3f}-{max(peaks):.3f}" if peaks else "-"
    return f" {s['generated_tokens_per_s_per_device']:9.1f} {spread:>13}"


def device_lines(results: dict[str, dict], mesh: jax.sharding.Mesh) -> str:
    """Per policy, each device's pages in use (mean / peak over the steps, of its pool's ``pages_per_device``),
    devices named ``(data, model)``; a pool shared by the ``"model"`` axis (a latent cache) is named
    ``(data, *)``."""
    d, m = mesh.shape["data"], mesh.shape["model"]
    lines = []
    for name, s in results.items():
        means, peaks = s.get("pages_used_device_mean"), s.get("pages_used_device_peak")
        if not means:
            lines.append(f"# {name}: pages per device not recorded by this engine")
            continue
        shards = len(means) // d
        cells = [f"({i // shards},{i % shards if shards == m else '*'}) {mean:.0f}/{peak}"
                 for i, (mean, peak) in enumerate(zip(means, peaks))]
        lines.append(f"# {name}: pages used per device, mean/peak of {s['pages_per_device']}: " + ", ".join(cells))
    return "\n".join(lines)


def tokens_digest(outputs: list[list[int]]) -> str:
    """A short hash of a run's generated tokens (equal digests: equal tokens, e.g. across processes or meshes)."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def check_plot_path(path: str) -> None:
    """Raise :class:`UsageError` if matplotlib is missing or cannot write ``path``'s format (by its suffix)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    suffix = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise UsageError(f"--plot {path!r}: matplotlib cannot write .{suffix} files (use one of "
                         f"{', '.join(sorted(formats))})")


def save_plot(path: str, columns: dict[str, dict], num_pages: int) -> None:
    """Write a PNG of pages in use and running requests per step, one line per policy (``columns`` as
    returned by :func:`run_policy`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, col in columns.items():
        ax1.plot(col["pages_used"], label=f"recycle={name}")
        ax2.plot(col["running"], label=f"recycle={name}")
    ax1.axhline(num_pages, color="k", lw=0.8, ls="--", label="pages")
    ax1.set_ylabel("pages in use")
    ax2.set_ylabel("running requests")
    ax2.set_xlabel("engine step")
    ax1.legend()
    ax1.set_title("kvjax run: page memory in use, recycle none vs timely")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
