"""Matplotlib figures of the notebooks. Every function returns the ``Figure`` it drew (nothing is shown or
saved here) and draws only from the numbers it is given."""

from __future__ import annotations

import numpy as np

from kvjax.experiments.sweeps import column, select

_STYLE = {"none": dict(color="tab:gray", marker="o"), "timely": dict(color="tab:blue", marker="s")}
_POOL_LS = {"shared": "-", "partitioned": "--"}


def _plt():
    import matplotlib.pyplot as plt  # the notebook's backend (inline), or matplotlib's default (Agg headless)

    return plt


_LABELS = {"tokens_per_step": "generated tokens / step", "tokens_per_s": "generated tokens / s",
           "peak_concurrency": "peak running requests"}


def sweep_figure(rows: list[dict], *, vary: str, xlabel: str, pools=("shared",), logx: bool = False,
                 metrics=("tokens_per_step", "peak_concurrency")):
    """One panel per metric against the varied value (``row["value"]``), one line per (recycle, pool); the
    ``tokens_per_step`` panel also draws each policy's theoretical bound (``bound_tokens_per_step``, dotted)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for pool in pools:
            for rec in ("none", "timely"):
                rs = select(rows, pool=pool, recycle=rec)
                if not rs:
                    continue
                x = column(rs, "value")
                st = dict(_STYLE[rec], linestyle=_POOL_LS.get(pool, "-"))
                label = f"{rec} ({pool})" if len(pools) > 1 else rec
                ax.plot(x, column(rs, metric), label=label, **st)
                if metric == "tokens_per_step":
                    ax.plot(x, column(rs, "bound_tokens_per_step"), color=st["color"], linestyle=":", alpha=0.8,
                            label=f"bound {label}")
        ax.set_ylabel(_LABELS.get(metric, metric))
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        if logx:
            ax.set_xscale("log", base=2)
    fig.suptitle(f"fixed page memory, sweep over {vary}")
    fig.tight_layout()
    return fig


def pages_figure(traces: dict[str, dict], *, title: str = "pages in use over time"):
    """Pages in use (fraction of the pool) and running requests per step, one line per named trace. A trace is
    a dict with ``pages_used`` and ``running`` arrays and ``num_pages``."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for name, tr in traces.items():
        color = _STYLE.get(name.split()[0], {}).get("color")
        a.plot(np.asarray(tr["pages_used"]) / tr["num_pages"], label=name, color=color, lw=1)
        b.plot(tr["running"], label=name, color=color, lw=1)
    a.set_ylabel("pages in use / pages")
    b.set_ylabel("running requests")
    for ax in (a, b):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def engine_figure(runs: list[dict]):
    """Bars per engine run: generated tokens/s, tokens/step (with the bound) and peak running requests."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    names = [f"{r['recycle']}\n{r['pool']}" for r in runs]
    colors = [_STYLE[r["recycle"]]["color"] for r in runs]
    x = np.arange(len(runs))
    axes[0].bar(x, [r["summary"]["generated_tokens_per_s"] for r in runs], color=colors)
    axes[0].set_ylabel("generated tokens / s")
    axes[1].bar(x, [r["summary"]["generated_tokens_per_step"] for r in runs], color=colors)
    axes[1].scatter(x, [r["bound"] for r in runs], color="k", marker="_", s=400, label="bound", zorder=3)
    axes[1].set_ylabel("generated tokens / step")
    axes[1].legend(fontsize=8)
    axes[2].bar(x, [r["summary"]["running_peak"] for r in runs], color=colors)
    axes[2].set_ylabel("peak running requests")
    for ax in axes:
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("toy Qwen3.5 through the engine, same page memory")
    fig.tight_layout()
    return fig


def training_figure(history: dict):
    """Training loss and teacher-forced answer accuracy per step."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3))
    a.plot(history["loss"], lw=1)
    a.set_yscale("log")
    a.set_ylabel("loss (answers)")
    b.plot(history["accuracy"], lw=1)
    b.set_ylim(0, 1.02)
    b.set_ylabel("answer accuracy (train batch)")
    for ax in (a, b):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def accuracy_figure(accuracies: dict[str, float], by_distance: dict[str, np.ndarray], edges: np.ndarray, *,
                    chance: float):
    """Left: accuracy per condition (bars). Right: accuracy against query-to-store distance per condition."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1.1, 1]})
    names = list(accuracies)
    a.bar(np.arange(len(names)), [accuracies[n] for n in names],
          color=["tab:green" if n.startswith(("full", "none", "timely", "no cache")) else "tab:red" for n in names])
    a.axhline(chance, color="k", ls=":", lw=1, label="chance")
    a.set_xticks(np.arange(len(names)), names, rotation=30, ha="right", fontsize=8)
    a.set_ylim(0, 1.05)
    a.set_ylabel("answer accuracy")
    a.legend(fontsize=8)
    mids = 0.5 * (edges[:-1] + edges[1:])
    for name, acc in by_distance.items():
        b.plot(mids, acc, marker="o", label=name, lw=1)
    b.axhline(chance, color="k", ls=":", lw=1)
    b.set_xlabel("query-to-store distance (tokens)")
    b.set_ylabel("accuracy")
    b.set_ylim(0, 1.05)
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def block_table_figure(tables: np.ndarray, seq_lens: np.ndarray, *, page_size: int, window, sinks):
    """Heatmap of a head-wise batch's block tables ``i32[B, H_kv, max_blocks]``: one panel per sequence, rows =
    KV heads, columns = logical blocks; colour = page id, white = hole (-1), grey = past the sequence end."""
    plt = _plt()
    b, h, nb = tables.shape
    fig, axes = plt.subplots(b, 1, figsize=(max(6, 0.35 * nb), 0.9 * h * b + 0.6), squeeze=False)
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    vmax = max(int(tables.max()), 1)
    for i, ax in enumerate(axes[:, 0]):
        data = np.ma.masked_less(tables[i].astype(float), 0)
        im = ax.imshow(data, cmap=cmap, vmin=0, vmax=vmax, aspect="auto")
        used = -(-int(seq_lens[i]) // page_size)
        if used < nb:
            ax.axvspan(used - 0.5, nb - 0.5, color="0.85")
        for hh in range(h):
            for blk in range(min(used, nb)):
                if tables[i, hh, blk] >= 0:
                    ax.text(blk, hh, int(tables[i, hh, blk]), ha="center", va="center", fontsize=6, color="w")
        ax.set_yticks(range(h), [f"h{hh} w={window[hh]} s={sinks[hh]}" for hh in range(h)], fontsize=7)
        ax.set_xticks(range(nb))
        ax.tick_params(axis="x", labelsize=6)
        ax.set_title(f"sequence {i}: {int(seq_lens[i])} tokens", fontsize=8)
    axes[-1, 0].set_xlabel("logical block (page_size positions each)")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="page id", shrink=0.8)
    return fig


_PREFIX_COLORS = {"none": "tab:gray", "timely": "tab:blue", "prefix": "tab:olive", "timely+keep_tail": "tab:green",
                  "timely+eager": "tab:red"}


def prefix_figure(rows: list[dict], *, title: str = "prefix reuse at fixed memory"):
    """Grouped bars per workload, one bar per policy (rows of :mod:`kvjax.experiments.prefix_runs`): prompt
    tokens computed (solid) with those served from the cache stacked on top (hatched), and generated tokens per
    step."""
    plt = _plt()
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.6))
    width = 0.8 / len(policies)
    for j, policy in enumerate(policies):
        rs = [next(r for r in rows if r["workload"] == w and r["policy"] == policy) for w in workloads]
        x = np.arange(len(workloads)) + (j - (len(policies) - 1) / 2) * width
        color = _PREFIX_COLORS.get(policy)
        computed = np.array([r["computed"] for r in rs])
        a.bar(x, computed, width, color=color, label=policy)
        a.bar(x, [r["served"] for r in rs], width, bottom=computed, color=color, alpha=0.35, hatch="//")
        b.bar(x, [r["tokens_per_step"] for r in rs], width, color=color, label=policy)
    a.set_ylabel("prompt tokens: computed (solid) + served (hatched)")
    b.set_ylabel("generated tokens / step")
    for ax in (a, b):
        ax.set_xticks(np.arange(len(workloads)), workloads)
        ax.grid(alpha=0.3, axis="y")
    b.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
