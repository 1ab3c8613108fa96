import pytest

from tunegrid.cell.precision import make_grad_scaler, plan_precision


@pytest.mark.parametrize(
    ("precision", "dtype", "autocast", "scaler"),
    [("fp32", "float32", False, False), ("bf16", "bfloat16", True, False), ("fp16", "float16", True, True)],
)
def test_plan(precision, dtype, autocast, scaler):
    plan = plan_precision(precision, "cpu")
    assert plan.compute_dtype == dtype == plan.storage_dtype
    assert plan.adapter_dtype == "float32"
    assert plan.autocast is autocast
    assert (make_grad_scaler(plan) is not None) is scaler
    assert precision in plan.describe()


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        plan_precision("fp8", "cpu")
