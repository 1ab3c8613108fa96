import pytest

from tunegrid.cell.loop.precision import make_grad_scaler, precision_setup


@pytest.mark.parametrize(
    ("precision", "dtype", "autocast", "scaler"),
    [("fp32", "float32", False, False), ("bf16", "bfloat16", True, False), ("fp16", "float16", True, True)],
)
def test_precision_setup(precision, dtype, autocast, scaler):
    setup = precision_setup(precision, "cpu")
    assert setup.compute_dtype == dtype == setup.storage_dtype
    assert setup.adapter_dtype == "float32"
    assert setup.autocast is autocast
    assert (make_grad_scaler(setup) is not None) is scaler
    assert precision in setup.describe()


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        precision_setup("fp8", "cpu")
