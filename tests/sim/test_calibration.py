"""Calibration files: the CPU coefficients are the fit of their measurements; GPU costs follow the roofline."""

from __future__ import annotations

import pytest

from infinite_llm.sim.calibration import GIB, fit_coefficients, load_calibration
from infinite_llm.sim.models import get_model


def test_cpu_coefficients_are_the_fit_of_the_readme_measurements():
    cal = load_calibration("cpu")
    assert fit_coefficients(cal.measurements) == cal.coefficients
    # the fit reproduces the measured steps within 2.5% (relative least squares)
    c = cal.coefficients
    for batch, seconds in cal.measurements["decode_steps"]:
        assert c["fixed_s"] + (c["seq_s"] + c["token_s"]) * batch == pytest.approx(seconds, rel=0.025)
    for n, seconds in cal.measurements["prefill_steps"]:
        assert c["fixed_s"] + c["seq_s"] + c["token_s"] * n + c["pair_s"] * n * n / 2 == pytest.approx(
            seconds, rel=0.025
        )


def test_a100_instance_of_llama2_7b_holds_what_its_memory_leaves():
    cost = load_calibration("a100").instance_cost(get_model("llama2-7b"), tp=1)
    usable = 80 * GIB * 0.9 - 2 * GIB - 6.738e9 * 2
    assert cost.kv_capacity_tokens == int(usable // (2 * 32 * 32 * 128 * 2)) == 117_656
    assert cost.weights_s == pytest.approx(6.738e9 * 2 / (2.039e12 * 0.75))
    big = load_calibration("a100").instance_cost(get_model("llama2-7b"), tp=8, pp=4)
    assert big.fixed_s == pytest.approx(0.002 + 2 * 32 * 1.5e-5 + 3 * 3e-5)
    assert big.decode_attn_s(1000, batch=1) == pytest.approx(4 * big.decode_attn_s(1000, batch=4))


def test_a_model_that_does_not_fit_and_a_fitted_file_for_another_model_are_refused():
    with pytest.raises(ValueError, match="does not fit"):
        load_calibration("a100").instance_cost(get_model("llama2-70b"), tp=1)
    with pytest.raises(ValueError, match="fitted for smollm2-135m"):
        load_calibration("cpu").instance_cost(get_model("llama2-7b"), kv_memory_bytes=1e9)
    with pytest.raises(ValueError, match="KV memory"):
        load_calibration("cpu").instance_cost(get_model("smollm2-135m"))


def test_a_malformed_calibration_file_names_the_problem(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nkind: hardware\nsource: s\nhardware: {memory_bytes: 1}\n")
    with pytest.raises(ValueError, match="hardware needs exactly"):
        load_calibration(str(path))
    with pytest.raises(ValueError, match="no such file"):
        load_calibration(str(tmp_path / "missing.yaml"))
