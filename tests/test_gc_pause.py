"""The collector pause of start-up: no collection inside, the collector as found after."""

import contextlib
import gc

import pytest

from ls_jax.training.gc_pause import collection_paused


@pytest.mark.parametrize("enabled_before", [True, False], ids=["on", "off"])
@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_the_collector_is_off_inside_and_as_found_after(enabled_before, raises):
    (gc.enable if enabled_before else gc.disable)()
    try:
        with pytest.raises(ValueError) if raises else contextlib.nullcontext():
            with collection_paused():
                assert not gc.isenabled()
                if raises:
                    raise ValueError("inside")
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable()


def test_freeze_moves_the_objects_alive_at_the_end_out_of_view():
    before, alive = gc.get_freeze_count(), []
    try:
        with collection_paused(freeze=True):
            alive.append([[i] for i in range(1000)])
        frozen = gc.get_freeze_count()
        assert frozen >= before + 1000
        with collection_paused():
            alive.append([[i] for i in range(1000)])
        assert gc.get_freeze_count() == frozen  # without freeze, nothing more is frozen
    finally:
        gc.unfreeze()

