"""``distmis init``: the specs it writes for three different data sets are accepted by ``validate`` and trained end to
end by ``distmis run``; a file that exists is not replaced unless asked."""

from __future__ import annotations

import pytest
import yaml

from distmis.cli.main import main
from tests.search.test_draft_spec import write_datasets


@pytest.mark.slow  # three searches of one trial and one epoch each, on the session's Ray (about a minute)
def test_init_specs_of_three_data_sets_validate_and_train_end_to_end(tmp_path, monkeypatch, capsys, ray_local):
    monkeypatch.chdir(tmp_path)
    datasets = write_datasets(tmp_path / "data")
    for key, path in datasets.items():
        spec = tmp_path / f"{key}.yaml"
        assert main(["init", str(path), "-o", str(spec), "--workers", "2", "--memory-per-worker", "2GB"]) == 0
        out = capsys.readouterr().out
        assert f"wrote {spec}" in out and f"distmis run {spec}" in out
        tree = yaml.safe_load(spec.read_text())
        assert tree["dataset"]["path"] == f"data/{key}"  # below the working directory: written relative to it
        assert main(["validate", str(spec)]) == 0
        assert "| trial | network | tile |" in capsys.readouterr().out  # every trial's predicted step
        assert main(["run", str(spec), "--quiet", "--set", "training.epochs=1", "--set", "search.num_samples=1"]) == 0
        out = capsys.readouterr().out
        assert "1 trial(s), 0 failed" in out and f"registered as models:/{tree['name']}/1" in out, out


def test_init_prints_the_spec_without_o_and_keeps_a_file_it_did_not_write(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    datasets = write_datasets(tmp_path / "data")
    kept = tmp_path / "spec.yaml"
    kept.write_text("mine\n")
    assert main(["init", str(datasets["mri"]), "-o", str(kept), "--memory-per-worker", "2GB"]) == 2
    assert "spec.yaml: the file exists; --force replaces it" in capsys.readouterr().err
    assert kept.read_text() == "mine\n"
    assert main(["init", str(datasets["mri"]), "--memory-per-worker", "2GB", "--networks", "unet3d"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith(f"# distmis init {datasets['mri']} --memory-per-worker 2GB --networks unet3d\n")
    assert "planned training.tile" in printed.err
    assert yaml.safe_load(printed.out)["model"]["name"] == "unet3d"
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal of an argument
        main(["init", str(datasets["mri"]), "--networks", "unet3d,unet2d"])
    assert refused.value.code == 2
    assert "unknown network(s) unet2d; registered: unet3d," in capsys.readouterr().err
