"""The benchmark's report: runs side by side in a table, and the memory workload's
figures and its picture of the KV pool over time (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

from ..kernels.fast.linear_paths import LinearPaths
from ..memory.fragmentation import summarize


def print_table(workload: str, cfg: dict, results: dict[str, dict]) -> None:
    """Several runs of one trace, side by side."""
    labels = list(results)
    keys = list(results[labels[0]])
    width = max(len(k) for k in keys)
    print(f"\n{workload}: {cfg}")
    print(f"  {'':<{width}}  " + "  ".join(f"{label:>12}" for label in labels))
    for key in keys:
        cells = [results[label][key] for label in labels]
        shown = [f"{c:12.4g}" if isinstance(c, float) else f"{str(c):>12}" for c in cells]
        print(f"  {key:<{width}}  " + "  ".join(shown))


def print_result(workload: str, cfg: dict, result: dict) -> None:
    """One run's figures, one per line."""
    width = max(len(k) for k in result)
    print(f"\n{workload}: {cfg}")
    for key, value in result.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            shown = f"({len(value)} rows, in the JSON)"
        else:
            shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"  {key:<{width}}  {shown}")


def memory_figures(engine, result: dict) -> dict:
    """The memory workload's headline numbers, from the engine's per-step slot accounting."""
    summary = summarize(engine.kv_history)
    return {"utilization": summary["utilization"], "max_concurrent_requests": summary["max_concurrent_requests"],
            "throughput_tok_s": result["generation_tok_s"],
            "reserved_fraction": summary["reserved_fraction_of_allocated"],
            "internal_fraction": summary["internal_fraction_of_allocated"],
            "external_fraction_of_pool": summary["external_fraction_of_pool"]}


def plot_memory(histories: dict, path: str) -> None:
    """KV pool over time, one panel per allocator: used / reserved / internal / external / free."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    fig, axes = plt.subplots(len(histories), 1, figsize=(9, 2.6 * len(histories)), sharey=True, squeeze=False)
    colors = {"used": "#2a7", "reserved": "#9cf", "internal": "#f96", "external": "#c33", "free": "#eee"}
    for ax, (label, history) in zip(axes[:, 0], histories.items()):
        pool = [h.allocated + h.free for h in history]
        layers = {"used": [h.used for h in history], "reserved": [h.reserved for h in history],
                  "internal": [h.internal for h in history], "external": [h.external for h in history],
                  "free": [h.free - h.external for h in history]}
        ax.stackplot(range(len(history)), *[[v / p for v, p in zip(vals, pool)] for vals in layers.values()],
                     labels=list(layers), colors=[colors[k] for k in layers])
        summary = summarize(history)
        ax.set_title(f"{label}: utilization {summary['utilization']:.0%}, "
                     f"at most {summary['max_concurrent_requests']} requests at once", fontsize=10)
        ax.set_xlim(0, max(len(history) - 1, 1))
        ax.set_ylabel("share of KV pool")
    axes[0, 0].legend(loc="upper right", fontsize=8, ncol=5)
    axes[-1, 0].set_xlabel("engine step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_roofline(report: dict) -> None:
    """``bench roofline``: the machine's limits, then one row per decode batch and prefill."""
    m = report["machine"]
    print(f"\nroofline: matmul peak {m['matmul_peak'] / 1e9:.1f} GFLOP/s, read bandwidth "
          f"{m['read_bandwidth'] / 1e9:.1f} GB/s, last-level cache {m['last_level_cache_bytes'] >> 20} MiB"
          + (f", integer peak {m['integer_peak'] / 1e9:.0f} GOP/s (q4_1_a8's products)" if m.get("integer_peak") else ""))
    if m.get("probes"):
        print("  (the better of two probes, start and end: "
              + ", ".join(f"{p['matmul_peak'] / 1e9:.0f} / {p['read_bandwidth'] / 1e9:.1f}" for p in m["probes"])
              + " GFLOP/s / GB/s)")
    if report.get("kernels"):
        print(f"  kernels (kernels/ops.py): the {report['kernels']} tier")
    if report.get("linear_paths") and report.get("kernels") != "simple":   # the plain tier: BLAS throughout
        print(f"  linear layers (kernels/fast/linear_paths.py): {LinearPaths(**report['linear_paths']).describe()}")
    parts = ("matmuls", "lm_head", "attention", "other_kernels", "persistent", "sampler", "python")
    head = "  ".join(f"{p:>13}" for p in parts)
    print(f"  {'decode':>8} {'path':>5} {'ctx':>5} {'step ms':>8} {'bound ms':>8} {'ratio':>6} {'serial':>7} {'s.rat':>6} "
          f"{'mm GF/s':>8}  {head}")
    for r in report["decode"]:
        cells = "  ".join(f"{r['breakdown_s'][p] * 1e3:13.2f}" for p in parts)
        print(f"  {'B=' + str(r['batch']):>8} {r['linear_path']:>5} {r['mean_context']:5.0f} {r['step_s'] * 1e3:8.1f} "
              f"{r['bound_s'] * 1e3:8.1f} {r['ratio']:6.2f} {r['serial_bound_s'] * 1e3:7.1f} {r['serial_ratio']:6.2f} "
              f"{r['matmul_gflop_s']:8.1f}  {cells}")
        if "layer_by_layer" in r:
            lbl = r["layer_by_layer"]
            cells = "  ".join(f"{lbl['breakdown_s'][p] * 1e3:13.2f}" for p in parts)
            print(f"  {'layers':>8} {'':>5} {'':>5} {lbl['step_s'] * 1e3:8.1f} {'':>8} {lbl['ratio']:6.2f} {'':>7} "
                  f"{lbl['serial_ratio']:6.2f} {'':>8}  {cells}")
    if report["prefill"]:
        print(f"  {'prefill':>8} {'path':>5} {'':>5} {'step ms':>8} {'bound ms':>8} {'ratio':>6} {'serial':>7} {'s.rat':>6} "
              f"{'GF/s':>8}  {head}")
    for r in report["prefill"]:
        cells = "  ".join(f"{r['breakdown_s'][p] * 1e3:13.2f}" for p in parts)
        print(f"  {'T=' + str(r['prompt_len']):>8} {r['linear_path']:>5} {'':>5} {r['step_s'] * 1e3:8.1f} {r['bound_s'] * 1e3:8.1f} "
              f"{r['ratio']:6.2f} {r['serial_bound_s'] * 1e3:7.1f} {r['serial_ratio']:6.2f} {r['gflop_s']:8.1f}  "
              f"{cells}   ({100 * r['fraction_of_peak']:.0f}% of peak)")
    print("  (path: the engine of the step's linear layers, numba (our panels, persistent kernel and BLAS)\n"
          "   or mkl (oneMKL's packed GEMM); breakdown in ms per step; ratio = step / bound, 1.00 is the\n"
          "   roofline; serial: the bound when attention's K/V reading cannot hide under the products'\n"
          "   arithmetic (the products' bound, then attention's), s.rat the step's ratio to it; persistent:\n"
          "   a decode step's layers and LM head in one kernel, products, attention and the rest together;\n"
          "   the 'layers' line under it: the same steps again layer by layer, kernel by kernel)")
