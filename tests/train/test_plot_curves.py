"""`jaxdist plot`: a log-scale loss axis, throughput without the windows that compile, learning-rate and
gradient-norm panels, a title naming the run; damaged or null values do not stop it."""

import json

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from jaxdist.train import plot  # noqa: E402

STEPS = 10


def _rows() -> list[dict]:
    """A resumed run's rows: step 1 and step 6 (the resume) compiled, so their throughput is low."""
    rows = []
    for step in range(1, STEPS + 1):
        row = {
            "step": step,
            "loss": 5.0 * 0.7**step,
            "lr": 1e-3 * min(1.0, step / 3),
            "grad_norm": 2.0 / step,
            "tokens_per_s": 10.0 if step in (1, 6) else 9000.0 + step,
        }
        if step == 6:
            row["includes_compile"] = True
        if step % 5 == 0:
            row["val_loss"] = 5.5 * 0.7**step
        rows.append(row)
    rows[3]["loss"] = None  # not finite when logged
    return rows


@pytest.fixture
def run_dir(tmp_path):
    out = tmp_path / "my-run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return out


def _panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def test_plot_draws_four_panels_with_log_loss_and_throughput_without_compiling_windows(run_dir, capsys):
    plt.close("all")
    assert plot.plot(str(run_dir)) == 0
    assert (run_dir / "curves.png").stat().st_size > 0
    fig = plt.gcf()
    assert "my-run" in fig.get_suptitle()
    panels = _panels(fig)
    assert set(panels) == {"loss", "throughput", "learning rate", "gradient norm"}
    assert panels["loss"].get_yscale() == "log"
    assert panels["gradient norm"].get_yscale() == "log"
    train, val = panels["loss"].lines
    expected = [(r["step"], r["loss"]) for r in _rows() if r["loss"] is not None]
    np.testing.assert_allclose(np.column_stack(train.get_data()), expected)
    np.testing.assert_allclose(val.get_xdata(), [5, 10])
    (tps,) = panels["throughput"].lines
    assert list(tps.get_xdata()) == [s for s in range(1, STEPS + 1) if s not in (1, 6)]
    assert min(tps.get_ydata()) > 9000
    (lr,) = panels["learning rate"].lines
    np.testing.assert_allclose(lr.get_ydata(), [1e-3 * min(1.0, s / 3) for s in range(1, STEPS + 1)])
    (norm,) = panels["gradient norm"].lines
    np.testing.assert_allclose(norm.get_ydata(), [2.0 / s for s in range(1, STEPS + 1)])
    plt.close("all")


def test_plot_drops_a_cut_short_last_row_and_skips_a_damaged_one_with_a_warning(run_dir, capsys):
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = "#garbage"
    path.write_text("\n".join(lines) + '\n{"step": 11, "loss": 0.1, "lr": 0.0, "grad_norm": 1.0, "tokens_pe')
    plt.close("all")
    assert plot.plot(str(run_dir)) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert f"line 3 of {path} is not a metrics row" in err[0]
    assert f"the last row of {path} (line 11) is incomplete" in err[1] and "dropped" in err[1]
    (lr,) = _panels(plt.gcf())["learning rate"].lines
    assert list(lr.get_xdata()) == [s for s in range(1, STEPS + 1) if s != 3]
    plt.close("all")


def test_plot_of_a_run_without_rows_says_so(run_dir, capsys):
    (run_dir / "metrics.jsonl").write_text("")
    assert plot.plot(str(run_dir)) == 2
    assert "holds no metrics rows" in capsys.readouterr().err
