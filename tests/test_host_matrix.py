"""The host matrix: the suite runs on the host it says, and every patch checks the shape of its seam."""

import os

import pytest
import rkharness

pytestmark = pytest.mark.foundation


def test_the_suite_runs_on_the_host_the_matrix_named():
    """scripts/test.sh sets REUSEKIT_TEST_HOST per host: the ComfyUI imported here is that one."""
    import comfyui_version

    wanted = os.environ.get("REUSEKIT_TEST_HOST")
    if not wanted:
        pytest.skip("run outside scripts/test.sh (no host named)")
    assert comfyui_version.__version__ == {"0.3.75": "0.3.75", "0.33": "0.33.0"}[wanted]
    assert rkharness.pack("patches.host").comfyui_version() == comfyui_version.__version__


def test_a_seam_of_the_expected_shape_passes_the_check():
    import comfy.model_base
    import comfy.sd

    host = rkharness.pack("patches.host")
    assert host.differs(comfy.sd.CLIP.encode_from_tokens, ("self", "tokens", "return_pooled")) is None
    assert host.differs(comfy.model_base.BaseModel.apply_model,
                        ("self", "x", "t", "c_concat", "c_crossattn", "control", "transformer_options")) is None
    assert host.differs(comfy.sd.VAE, attrs=("encode", "encode_tiled")) is None


def test_a_reshaped_seam_is_named_and_leaves_its_feature_off_with_one_warning(caplog):
    import comfy.sd

    host = rkharness.pack("patches.host")

    def encode_from_tokens(self, token_batches, options=None):  # a newer host's shape, say
        return None

    why = host.differs(encode_from_tokens, ("self", "tokens", "return_pooled"))
    assert why is not None and "token_batches" in why
    assert host.differs(None) == "it is missing"
    # a replacement with a fixed signature needs exactly the parameters it passes on
    assert host.differs(encode_from_tokens, ("self", "token_batches"), exact=True) is not None
    assert host.differs(encode_from_tokens, ("self", "token_batches", "options"), exact=True) is None
    assert "no_such_method" in host.differs(comfy.sd.CLIP, attrs=("encode", "no_such_method"))
    feature = "test feature (reshaped)"
    with caplog.at_level("WARNING", logger="reusekit"):
        for _ in range(3):
            assert host.check(feature, "comfy.sd.CLIP.encode_from_tokens", encode_from_tokens,
                              ("self", "tokens")) is False
    warnings = [r.getMessage() for r in caplog.records if feature in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert host.comfyui_version() in warnings[0] and "token_batches" in warnings[0]
    assert "comfy.sd.CLIP.encode_from_tokens" in host.off_features()[feature]


def test_the_server_start_says_which_layers_are_on(comfy_server):
    import comfyui_version

    lines = [line for line in comfy_server.log_text().splitlines() if "ReuseKit 0." in line and " on ComfyUI " in line]
    assert len(lines) == 1, lines
    line = lines[0]
    assert f"on ComfyUI {comfyui_version.__version__}:" in line
    for layer in ("conditioning cache on", "PE cache on", "step cache on (flux", "graph capture ", "panel on"):
        assert layer in line, line
