"""Draw simulation time series to a PNG (matplotlib, Agg backend, imported only when called).

Every variant has one style (colour and line style) used in every panel, and one legend entry
in a single legend beside the panels, so 16 variants (:data:`~pagedkv.sim.variants.MAX_VARIANTS`)
stay tellable apart: ten colours, then the same ten dashed, dotted and dash-dotted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.errors import InvalidRequestError
from pagedkv.sim.report import SimReport

_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D")


def variant_style(i: int) -> dict[str, str]:
    """Colour, line style and marker of the ``i``-th variant: distinct for i < 40."""
    return {
        "color": f"C{i % 10}",
        "ls": _LINESTYLES[(i // 10) % len(_LINESTYLES)],
        "marker": _MARKERS[(i // 10) % len(_MARKERS)],
    }


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidRequestError(
            "--plot needs matplotlib: pip install 'pagedkv[sim]' (or matplotlib)"
        ) from None
    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    """Write ``fig`` to ``path`` and close it; an unwritable path is an InvalidRequestError."""
    plt = _pyplot()
    try:
        fig.savefig(str(path), dpi=100, bbox_inches="tight")
    except OSError as exc:
        raise InvalidRequestError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def plot_reports(reports: Sequence[SimReport], path: str | Path, *, title: str = "") -> None:
    """Five panels over simulated time, one line per variant: KV usage, running requests,
    waiting requests, step time (the inter-token latency of the decodes in it), and TTFT per
    request.

    Raises InvalidRequestError if matplotlib is missing or the file cannot be written.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(5, 1, figsize=(11, 13), sharex=True)
    ax_usage, ax_run, ax_wait, ax_step, ax_ttft = axes
    for i, r in enumerate(reports):
        st = variant_style(i)
        line = {"color": st["color"], "ls": st["ls"], "lw": 1.0}
        s = r.series
        ax_usage.plot(s.t_s, [u * 100 for u in s.usage], label=r.label, **line)
        ax_run.plot(s.t_s, s.num_running, **line)
        ax_wait.plot(s.t_s, s.num_waiting, **line)
        ax_step.plot(s.t_s, [x * 1e3 for x in s.step_s], **{**line, "lw": 0.7})
        ax_ttft.scatter(
            s.ttft_at_s,
            [x * 1e3 for x in s.ttft_s],
            color=st["color"],
            marker=st["marker"],
            s=5,
            alpha=0.5,
        )
    ax_usage.set_ylabel("KV usage (%)")
    ax_usage.set_ylim(0, 105)
    ax_run.set_ylabel("running")
    ax_wait.set_ylabel("waiting")
    ax_step.set_ylabel("step time = ITL (ms)")
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_yscale("log")
    ax_ttft.set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    ncol = 1 if len(reports) <= 20 else 2
    fig.legend(
        *ax_usage.get_legend_handles_labels(),
        loc="upper left",
        bbox_to_anchor=(1.0, 0.97),
        fontsize=8,
        ncol=ncol,
        title="variant",
        frameon=False,
    )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)
