import subprocess
import sys

import pytest

from rlt_engine.core.exit_rule import ExitTracker, LoopControls, f32


def _run(hazards, controls):
    tracker = ExitTracker(controls)
    for h in hazards:
        if tracker.step(h):
            break
    return tracker.loops_done


def test_fixed_depth_at_threshold_one_even_with_certain_exit():
    assert _run([1.0, 1.0, 1.0, 1.0], LoopControls(1, 4, 1.0)) == 4


def test_threshold_and_min_loops():
    hazards = [0.5, 0.5, 0.5, 0.5]  # CDF: 0.5, 0.75, 0.875, 0.9375
    assert _run(hazards, LoopControls(1, 4, 0.5)) == 1
    assert _run(hazards, LoopControls(2, 4, 0.5)) == 2
    assert _run(hazards, LoopControls(1, 4, 0.8)) == 3
    assert _run(hazards, LoopControls(1, 2, 0.99)) == 2
    assert _run(hazards, LoopControls(3, 3, 0.0)) == 3


def test_gateless_models_run_to_max_loops():
    assert _run([None, None], LoopControls(1, 2, 0.1)) == 2
    assert _run([None, None], LoopControls(1, 1, 1.0)) == 1


def test_arithmetic_is_float32():
    assert f32(0.1) != 0.1 and f32(f32(0.1)) == f32(0.1)
    tracker = ExitTracker(LoopControls(1, 4, 1.0))
    tracker.step(0.1)
    assert tracker.remaining == f32(1 - f32(0.1))


@pytest.mark.parametrize(
    "controls", [LoopControls(0, 4, 1.0), LoopControls(3, 2, 1.0), LoopControls(1, 5, 1.0)]
)
def test_invalid_controls(controls):
    with pytest.raises(ValueError, match="min_loops"):
        controls.validate(4)
    with pytest.raises(ValueError, match="exit_threshold"):
        LoopControls(1, 4, 1.5).validate(4)


def test_core_never_imports_torch():
    code = (
        "import pkgutil, importlib, sys, rlt_engine.core as core\n"
        "for m in pkgutil.walk_packages(core.__path__, 'rlt_engine.core.'):\n"
        "    importlib.import_module(m.name)\n"
        "assert 'torch' not in sys.modules, 'rlt_engine.core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
