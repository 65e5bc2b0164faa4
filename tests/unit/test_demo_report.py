"""What `flyserve demo` prints: the phase's own figures apart from the running totals, the word that
the CPU prefill path is a stand-in, and where the sidecar was."""

from __future__ import annotations

from flyserve.demo.report import CPU_KERNEL_NOTE, closing_lines, live_line, phase_figures


def _stats(batches: int, unified: int, prefill: int, no_prefill_rows: int, version: int = 1) -> dict:
    return {
        "thresholds": {"version": version},
        "totals": {
            "batches": batches,
            "decisions": {"unified": unified, "prefill": prefill},
            "reasons": {"no_prefill_rows": no_prefill_rows, "admitted": prefill, "short_context": 0},
        },
        "kernels": {
            "prefill": {"count": 5, "mean_s": 0.00221},
            "unified": {"count": 9, "mean_s": 0.00003},
        },
    }


def test_phase_figures_are_deltas():
    start, end = _stats(1000, 800, 200, 700), _stats(1100, 860, 240, 740)
    ph = phase_figures(start, end)
    assert (ph["batches"], ph["prefill"], ph["batches_with_prefill_rows"]) == (100, 40, 60)
    assert ph["prefill_ratio_of_prefill_batches"] == 40 / 60
    assert ph["reasons"] == {"no_prefill_rows": 40, "admitted": 40}


def test_live_line_keeps_phase_figures_apart_from_running_totals():
    line = live_line(_stats(1100, 860, 240, 740), _stats(1000, 800, 200, 700), 12.0, "after")
    this_phase, totals, kernels = line.split(" | ")[1:]
    assert this_phase.startswith("this phase: 100 batches, 60 with a prefill row, 66.7% of those to prefill")
    assert "1100" not in this_phase and "240" not in this_phase  # no running total in the phase part
    assert totals == "totals: 1100 batches, unified 860, prefill 240"
    assert kernels == "kernel mean (CPU stand-in) prefill 2.21ms unified 0.03ms"


def test_the_cpu_prefill_path_is_called_a_stand_in():
    assert "deliberately simple stand-in" in CPU_KERNEL_NOTE and "say nothing" in CPU_KERNEL_NOTE


def test_closing_lines_say_where_the_sidecar_is_and_whether_it_stays():
    phases = [{"prefill_ratio_of_prefill_batches": 0.8}, {"prefill_ratio_of_prefill_batches": 0.2}]
    req = {"sent": 10, "completed": 10, "failed": 0}
    gone = closing_lines(phases, req, "http://127.0.0.1:4242", 0)
    assert "before the change 80.0%, after 20.0%" in gone[1]
    assert "http://127.0.0.1:4242/dispatch-stats" in gone[-1] and "stops with the demo" in gone[-1]
    held = closing_lines(phases, req, "http://127.0.0.1:4242", 60)
    assert "stays up for 60 s" in held[-1] and "http://127.0.0.1:4242/dispatch-stats" in held[-1]
