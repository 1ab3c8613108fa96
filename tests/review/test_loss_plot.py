"""The loss plot's non-finite mark sits at the step where it happened, never at a loss the step did not have."""

from __future__ import annotations


def test_a_nonfinite_step_is_marked_at_its_step_on_the_panel_edge_not_at_loss_zero():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tunegrid.review.plots import mark_nonfinite

    fig, ax = plt.subplots()
    ax.plot([0, 1, 2], [5.0, 4.0, 3.0])
    marker = mark_nonfinite(ax, 0, "red")  # non-finite at step 0: no finite loss before it
    fig.canvas.draw()
    assert list(marker.get_xdata()) == [0] and list(marker.get_ydata()) == [1.0]
    # y is in axes coordinates (the top edge), x in data coordinates (the step)
    x_px, y_px = marker.get_transform().transform((0, 1.0))
    assert abs(y_px - ax.transAxes.transform((0, 1.0))[1]) < 1e-6
    assert abs(x_px - ax.transData.transform((0, 3.0))[0]) < 1e-6
    assert ax.get_ylim()[0] > 0.5, "nothing was drawn at loss 0"
    plt.close(fig)
