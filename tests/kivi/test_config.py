import subprocess
import sys

import pytest

from kivi import KiviConfig, KiviConfigError
from kivi.config import cache_name, did_you_mean, preset_caches


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(k_bits=3), "k_bits"),
        (dict(v_bits=1), "v_bits"),
        (dict(group_size=24), "group_size"),
        (dict(group_size=0), "group_size"),
        (dict(residual_length=100), "residual_length"),
        (dict(residual_length=-32), "residual_length"),
        (dict(key_axis="chanel"), "key_axis"),
        (dict(value_axis="tokens"), "value_axis"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(layer_overrides={0: {"k_bit": 4}}), "layer_overrides[0]"),
        (dict(layer_overrides={1: {"k_bits": 5}}), "layer_overrides[1].k_bits"),
        (dict(layer_overrides={-1: {"k_bits": 4}}), "layer_overrides[-1]"),
    ],
)
def test_an_invalid_value_raises_one_error_naming_the_field(kwargs, field):
    with pytest.raises(KiviConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        KiviConfig(**kwargs)


def test_the_residual_error_proposes_valid_lengths():
    with pytest.raises(KiviConfigError, match="use 96 or 128"):
        KiviConfig(residual_length=100)


def test_a_misspelled_axis_or_preset_gets_a_suggestion():
    with pytest.raises(KiviConfigError, match="did you mean 'channel'"):
        KiviConfig(key_axis="chanel")
    with pytest.raises(KiviConfigError, match="did you mean 'kivi-2'"):
        KiviConfig.from_name("kivi2")


def test_did_you_mean_names_the_closest_choices_or_nothing():
    presets = ["kivi-2", "kivi-4", "kivi-8", "unquantized"]
    assert did_you_mean("kivi2", presets) == " (did you mean 'kivi-2'?)"
    assert did_you_mean("kivi2", presets, n=3) == " (did you mean 'kivi-2', 'kivi-8' or 'kivi-4'?)"
    assert did_you_mean("mmlu", presets) == ""


def test_importing_the_config_loads_no_torch():
    # kivi.config is the lowest layer: the CLI's archive commands import its names without torch.
    code = "import sys, kivi.config; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_zero_residual_is_allowed_and_named():
    assert KiviConfig(residual_length=0).name == "kivi-k2v2-g32-r0"


def test_layer_overrides_apply_to_their_layer_only():
    cfg = KiviConfig(layer_overrides={0: {"k_bits": 4, "v_bits": 4}})
    assert (cfg.for_layer(0).k_bits, cfg.for_layer(0).v_bits) == (4, 4)
    assert (cfg.for_layer(1).k_bits, cfg.for_layer(1).v_bits) == (2, 2)
    assert cfg.name == "kivi-k2v2-g32-r128-L0k4v4"


def test_presets_match_the_paper_settings():
    assert KiviConfig.from_name("kivi-2") == KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=128)
    token_keys = KiviConfig.from_name("token-keys-2")
    assert (token_keys.key_axis, token_keys.value_axis) == ("token", "token")


def test_a_preset_names_the_cache_of_its_configuration_and_any_other_name_is_itself():
    assert cache_name("kivi-2") == KiviConfig.from_name("kivi-2").name == "kivi-k2v2-g32-r128"
    assert cache_name("token-keys-2-r0") == "kivi-k2v2-g32-r0-ktoken"
    assert cache_name("kivi-k4v4-g32-r128") == "kivi-k4v4-g32-r128" and cache_name("fp16") == "fp16"
    assert len(set(preset_caches().values())) == len(preset_caches())  # one preset per archive name


def test_a_preset_is_also_named_by_its_cache_name_as_outputs_print_it():
    for preset, name in preset_caches().items():
        assert KiviConfig.from_name(name) == KiviConfig.from_name(preset)
    with pytest.raises(KiviConfigError, match="unknown KIVI preset 'kivi-k2v2-g32-r96'"):
        KiviConfig.from_name("kivi-k2v2-g32-r96")  # a valid configuration, but no preset's: a cache_overrides entry


def test_what_the_slot_cache_cannot_hold_is_decided_from_the_config_alone_without_torch():
    code = ("import sys\nfrom kivi.config import KiviConfig, slot_unsupported\n"
            "print(slot_unsupported(KiviConfig.from_name('kivi-2')), slot_unsupported(KiviConfig(sink_tokens=4)), "
            "'torch' in sys.modules, sep='|')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    none, sinks, torch_loaded = out.split("|")
    assert none == "None" and sinks.startswith("sink_tokens=4: the static decode engine keeps no sink buffers")
    assert torch_loaded == "False"
