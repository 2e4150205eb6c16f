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


class Heard(list):
    """Listener calls as (event, patcher type, args, kwargs); detaches apart in ``detached`` (the
    garbage collector detaches other tests' patchers at any time: ModelPatcher.__del__)."""

    def __init__(self):
        super().__init__()
        self.detached = []

    def listener(self, event):
        into = self.detached if event == "detach" else self
        return lambda patcher, *args, **kwargs: into.append((event, type(patcher).__name__, args, kwargs))


@pytest.fixture
def heard(lifecycle):
    calls = Heard()
    listeners = {e: calls.listener(e) for e in lifecycle.EVENTS}
    for event, fn in listeners.items():
        lifecycle.add_listener(event, fn)
    yield calls
    for event, fn in listeners.items():
        lifecycle.remove_listener(event, fn)


def test_a_subclass_override_fires_once_with_its_own_arguments(lifecycle, heard, tiny):
    """Subclasses defined before and after the install; an override that calls super() fires once."""
    import comfy.model_patcher

    lifecycle.uninstall()

    class Before(comfy.model_patcher.ModelPatcher):
        def unpatch_model(self, device_to=None, unpatch_weights=True):
            return super().unpatch_model(device_to, unpatch_weights=False)  # as ModelPatcherDynamic does

    lifecycle.install()

    class After(Before):
        def unpatch_model(self, device_to=None, unpatch_weights=True):
            return super().unpatch_model(device_to, unpatch_weights)

        def detach(self, unpatch_all=True):
            return super().detach(unpatch_all)

    base = tiny.tiny_flux(0)
    patchers = [cls(base.model, base.load_device, base.offload_device) for cls in (Before, After)]
    for patcher in patchers:  # (kept alive: ComfyUI's ModelPatcher.__del__ detaches)
        heard.clear()
        patcher.unpatch_model(base.offload_device, unpatch_weights=True)
        assert heard == [("unpatch_model", type(patcher).__name__, (base.offload_device,), {"unpatch_weights": True})]
    patchers[1].detach(unpatch_all=False)
    assert [h for h in heard.detached if h[1] == "After"] == [("detach", "After", (), {"unpatch_all": False})]
    assert all(lifecycle.wrapped(c, "unpatch_model") for c in (comfy.model_patcher.ModelPatcher, Before, After))
    lifecycle.uninstall()
    assert "__init_subclass__" not in comfy.model_patcher.ModelPatcher.__dict__
    assert not any(hasattr(c.__dict__["unpatch_model"], lifecycle.MARK) for c in (Before, After))


def test_the_dynamic_vram_patcher_is_heard_once_per_call(lifecycle, heard, tiny):
    """ComfyUI's real ModelPatcherDynamic (0.16+) overrides load, unpatch_model and partially_unload."""
    from graph_helpers import dynamic_patcher

    base = tiny.tiny_flux(0)
    dyn = dynamic_patcher(base)
    dyn.unpatch_model(base.offload_device)  # its own override, which calls super() and partially_unload
    assert heard == [("unpatch_model", "ModelPatcherDynamic", (base.offload_device,), {}),
                     ("partially_unload", "ModelPatcherDynamic", (None, 1e32), {})]
    heard.clear()
    dyn.partially_unload(None, 1e32)
    assert heard == [("partially_unload", "ModelPatcherDynamic", (None, 1e32), {})]
    heard.clear()
    with pytest.raises(RuntimeError, match="aimdo"):  # loading needs a CUDA device: heard before it fails
        dyn.load(dyn.load_device)
    assert heard == [("load", "ModelPatcherDynamic", (dyn.load_device,), {})]


def test_a_reshaped_method_stays_unwrapped_with_one_warning(lifecycle, heard, tiny, caplog):
    import logging

    import comfy.model_patcher

    host = rkharness.pack("patches.host")

    class Reshaped(comfy.model_patcher.ModelPatcher):
        def partially_unload(self, memory_to_free, device_to=None):  # the listeners' arguments moved
            return super().partially_unload(device_to, memory_to_free)

    base = tiny.tiny_flux(0)
    patcher = Reshaped(base.model, base.load_device, base.offload_device)
    assert not lifecycle.wrapped(Reshaped, "partially_unload")
    assert "Reshaped.partially_unload" in " ".join(host.off_features().values())
    patcher.partially_unload(0, base.offload_device)  # heard once, through ModelPatcher's own method
    assert heard == [("partially_unload", "Reshaped", (base.offload_device, 0), {})]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="reusekit"):
        lifecycle.uninstall()
        lifecycle.install()
    assert not [r for r in caplog.records if "Reshaped" in r.getMessage()]  # said once, at the definition


def test_a_sibling_clone_changing_shared_weights_is_heard_only_by_the_global_wrap(lifecycle, heard, tiny):
    """Why graph capture and the PE cache follow ModelPatcher globally: a per-patcher callback
    (CallbacksMP) on the clone a node made never hears a sibling clone (a LoRA loader's) load, unload
    or re-patch the weights both share; the lifecycle listeners do."""
    import comfy.model_management as mm
    import comfy.patcher_extension
    import torch

    base = tiny.tiny_flux(0)
    node_clone = base.clone()
    callbacks = []
    for kind in ("ON_LOAD", "ON_DETACH"):
        node_clone.add_callback_with_key(getattr(comfy.patcher_extension.CallbacksMP, kind), "rktest",
                                         lambda patcher, *a, kind=kind: callbacks.append(kind))
    lora = base.clone()
    key = next(k for k in lora.model_state_dict() if k.endswith(".weight"))
    lora.add_patches({key: (torch.ones_like(lora.get_model_object(key)),)}, 0.1)
    mm.load_models_gpu([lora])  # the sibling patches the shared weights in place
    assert lora.model is node_clone.model and not callbacks
    assert any(h[0] == "load" for h in heard)
    mm.unload_all_models()
    assert not callbacks
    node_clone.detach(unpatch_all=True)  # its own callbacks hear the clone they are on
    assert callbacks == ["ON_DETACH"]
