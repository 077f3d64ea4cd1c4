"""Draw simulation time series to a PNG (matplotlib, Agg backend, imported only when called)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedkv.errors import InvalidRequestError
from pagedkv.sim.report import SimReport


def plot_reports(reports: Sequence[SimReport], path: str | Path, *, title: str = "") -> None:
    """Four panels over simulated time, one line per variant: KV usage, running and waiting
    requests, step time (the inter-token latency of the decodes in it), and TTFT per request.

    Raises InvalidRequestError if matplotlib is missing or the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidRequestError(
            "--plot needs matplotlib: pip install 'pagedkv[sim]' (or matplotlib)"
        ) from None
    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    ax_usage, ax_queue, ax_step, ax_ttft = axes
    for i, r in enumerate(reports):
        color = f"C{i}"
        s = r.series
        ax_usage.plot(s.t_s, [u * 100 for u in s.usage], color=color, label=r.label)
        ax_queue.plot(s.t_s, s.num_running, color=color, label=f"{r.label} running")
        ax_queue.plot(s.t_s, s.num_waiting, color=color, ls="--", label=f"{r.label} waiting")
        ax_step.plot(s.t_s, [x * 1e3 for x in s.step_s], color=color, label=r.label, lw=0.8)
        ax_ttft.scatter(
            s.ttft_at_s, [x * 1e3 for x in s.ttft_s], color=color, s=4, label=r.label, alpha=0.6
        )
    ax_usage.set_ylabel("KV usage (%)")
    ax_usage.set_ylim(0, 105)
    ax_queue.set_ylabel("requests")
    ax_step.set_ylabel("step time = ITL (ms)")
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_yscale("log")
    ax_ttft.set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(str(path), dpi=100)
    except OSError as exc:
        raise InvalidRequestError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
