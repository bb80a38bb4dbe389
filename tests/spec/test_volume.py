"""A spec checked against a volume its fields do not fix (issue 46, finding 1): ``with_volume``."""

from __future__ import annotations

from distmis.spec import validate_spec
from distmis.spec.load import apply_config, check_spec, spec_to_dict, volume_shape, with_volume


def test_a_known_volume_holds_every_searched_network_and_stage_to_its_rule(spec_tree):
    tree = spec_tree
    del tree["dataset"]["synthetic"]  # a data set on disk: no field fixes the volume
    tree["model"] = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3}}
    tree["search"]["space"] = {"model.name": {"grid": ["unet3d", "swinunetr"]}}
    spec = validate_spec(tree)
    assert volume_shape(spec) is None and check_spec(spec) == []
    known = with_volume(spec, (16, 16, 16), "the cases' headers")
    assert volume_shape(known) == (16, 16, 16) and volume_shape(spec) is None  # a copy; the spec is unchanged
    assert spec_to_dict(known) == spec_to_dict(spec)  # nothing of it in the YAML a search records
    assert volume_shape(apply_config(known, {"model.name": "swinunetr"})) == (16, 16, 16)  # a trial's spec keeps it
    (path, message), = check_spec(known)
    assert path == "search.space.model.name"
    assert message.startswith("value 'swinunetr' makes training.tile (null: the whole volume) invalid: the whole "
                              "volume [16, 16, 16] (the cases' headers) is the network input")
    assert "must divide by 32 (swinunetr: SwinUNETR's 2^3 patches and four 2x patch mergings, 2**5)" in message
    assert check_spec(with_volume(spec, (64, 64, 64), "the cases' headers")) == []
    tree["dataset"]["crop"] = [64, 64, 64]  # a field that fixes the volume wins over the data's
    assert check_spec(with_volume(validate_spec(tree), (16, 16, 16), "the cases' headers")) == []
