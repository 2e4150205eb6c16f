"""The shared ModelPatcher lifecycle hook, on a real tiny model and ComfyUI's real unload path."""

import pytest
import rkharness

pytestmark = pytest.mark.foundation


@pytest.fixture
def lifecycle():
    mod = rkharness.pack("patches.lifecycle")
    yield mod
    mod.install()  # leave it as the pack has it


def test_listeners_hear_loads_and_unloads_and_errors_never_escape(lifecycle, tiny):
    import comfy.model_management as mm
    import comfy.model_patcher

    seen = []

    def record(patcher, *args, **kwargs):
        seen.append((type(patcher).__name__, args, kwargs))

    def broken(patcher, *args, **kwargs):
        raise RuntimeError("a listener bug")

    lifecycle.add_listener("detach", record)
    lifecycle.add_listener("detach", broken)
    lifecycle.add_listener("load", record)
    try:
        model = tiny.tiny_flux(0)
        mm.load_models_gpu([model])
        assert any(s[0] == "ModelPatcher" for s in seen)  # the load was heard
        seen.clear()
        mm.unload_all_models()  # ComfyUI's own unload path detaches the model
        assert seen and seen[0][0] == "ModelPatcher"
        assert getattr(comfy.model_patcher.ModelPatcher.detach, lifecycle.MARK)
    finally:
        for event in ("detach", "load"):
            lifecycle.remove_listener(event, record)
        lifecycle.remove_listener("detach", broken)
    with pytest.raises(ValueError, match="unknown ModelPatcher event"):
        lifecycle.add_listener("reload", record)


def test_install_is_idempotent_and_uninstall_restores_the_host(lifecycle):
    import comfy.model_patcher

    cls = comfy.model_patcher.ModelPatcher
    lifecycle.install()
    wrapped = {e: cls.__dict__[e] for e in lifecycle.EVENTS}
    lifecycle.install()
    assert {e: cls.__dict__[e] for e in lifecycle.EVENTS} == wrapped
    lifecycle.uninstall()
    for event in lifecycle.EVENTS:
        assert not hasattr(cls.__dict__[event], lifecycle.MARK)
        assert cls.__dict__[event] is wrapped[event].__wrapped__
    lifecycle.uninstall()
    assert not lifecycle.installed()
