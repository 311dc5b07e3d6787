"""YAML + dotted overrides into typed dataclasses, and errors that name key, source and fix."""

import re

import pytest

from areal_flow.config import ConfigError, ExperimentConfig

from areal_flow.config_load import load_config


def _yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_then_overrides_with_types(tmp_path):
    path = _yaml(tmp_path, "train:\n  lr: 0.5\n  steps: 3\nasync:\n  max_staleness: 4\n")
    cfg = load_config(path, ["train.lr=1e-4", "scheduler.type=ray", "train.loss.clip_eps_high=0.28"])
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.train.lr == 1e-4 and cfg.train.steps == 3
    assert cfg.async_.max_staleness == 4  # the YAML key 'async' is the field 'async_'
    assert cfg.scheduler.type == "ray"
    assert cfg.train.loss == {"clip_eps_high": 0.28}
    assert load_config(None, ["async.max_staleness=0"]).async_.max_staleness == 0


def test_unknown_key_in_yaml_names_file_line_and_nearest_key(tmp_path):
    path = _yaml(tmp_path, "seed: 3\ntrain:\n  steps: 2\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'train.lrr' \({path}:4\); did you mean 'train.lr'\?"):
        load_config(path)


def test_a_value_no_check_accepts_names_the_file_and_line_or_the_command_line(tmp_path):
    """Value checks run in the schema's ``__post_init__``; the error names where the value was set last."""
    path = _yaml(tmp_path, "seed: 3\ngen:\n  n_samples: 4\n  dtype: bf17\nasync:\n  max_staleness: -1\n")
    with pytest.raises(ConfigError, match=rf"^{path}:4: gen.dtype='bf17': expected auto or one of"):
        load_config(path, ["async.max_staleness=1"])
    with pytest.raises(ConfigError, match=rf"^{path}:6: async.max_staleness=-1: must be >= 0"):
        load_config(path, ["gen.dtype=auto"])
    with pytest.raises(ConfigError, match=r"^gen.dtype='fp8': .* \(command line\)$"):
        load_config(path, ["gen.dtype=fp8", "async.max_staleness=1"])  # the override wins over line 4

def test_unknown_override_suggests_nearest():
    with pytest.raises(ConfigError, match=r"'async.max_stalenes' \(command line\); did you mean 'async.max_staleness'"):
        load_config(None, ["async.max_stalenes=1"])


def test_wrong_type_names_key_and_expected_type(tmp_path):
    path = _yaml(tmp_path, "gen:\n  n_samples: many\n")
    with pytest.raises(ConfigError, match=rf"config key 'gen.n_samples' \({path}:2\):.*expected int"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"'train.lr' \(command line\).*expected float"):
        load_config(None, ["train.lr=fast"])


def test_loss_overrides_are_checked_against_loss_config():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.loss.clip_eps_hgh'; did you mean 'train.loss.clip_eps_high'"):
        load_config(None, ["train.loss.clip_eps_hgh=0.3"])
    with pytest.raises(ConfigError, match=r"train.loss: LossConfig.loss_agg_mode='per-token'"):
        load_config(None, ["train.loss.loss_agg_mode=per-token"])


def test_bad_values_and_malformed_input(tmp_path):
    with pytest.raises(ConfigError, match=r"scheduler.type='slurm': expected 'local' or 'ray'"):
        load_config(None, ["scheduler.type=slurm"])
    with pytest.raises(ConfigError, match=r"expected key=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match=r"invalid YAML"):
        load_config(_yaml(tmp_path, "train: [unclosed\n"))
    with pytest.raises(ConfigError, match=r"\.yaml:3: 'train' is written twice \(first on line 1\)"):
        load_config(_yaml(tmp_path, "train:\n  steps: 3\ntrain:\n  lr: 5\n"))  # PyYAML alone keeps lr, drops steps
    with pytest.raises(ConfigError, match=r"\.yaml:3: 'train.lr' is written twice \(first on line 2\)"):
        load_config(_yaml(tmp_path, "train:\n  lr: 1\n  lr: 5\n"))
    with pytest.raises(ConfigError, match=r"config file not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("override, message", [
    ("warm_start.teacher_bug_rate=1.5", r"warm_start.teacher_bug_rate=1.5: must be in \[0, 1\]"),
    ("warm_start.steps=-1", r"warm_start.steps=-1: must be >= 0"),
    ("warm_start.batch_size=0", r"warm_start.batch_size=0: must be >= 1"),
    ("train.steps=0", r"train.steps=0: must be >= 1"),
    ("gen.temperature=-1", r"gen.temperature=-1.0: must be >= 0"),
    ("gen.top_p=0", r"gen.top_p=0.0: must be in \(0, 1\]"),
    ("gen.max_new_tokens=0", r"gen.max_new_tokens=0: must be >= 1"),
    ("scheduler.threads_per_worker=-1", r"scheduler.threads_per_worker=-1: must be >= 0"),
])
def test_out_of_range_values_name_the_key_before_any_work(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("override, message", [
    ("train.lr=-1", "train.lr=-1.0: must be a finite number > 0"),
    ("train.lr=.nan", "train.lr=nan: must be a finite number > 0"),
    ("name=../../etc", "name='../../etc': must be a plain folder name"),
    ("name=", "name='': must be a plain folder name"),  # not "Incompatible value 'None'"
])
def test_a_learning_rate_and_a_run_name_that_cannot_work_are_refused(override, message):
    """Found by the new-user trial: these compiled without a word (name=../.. would write outside out_dir)."""
    from areal_flow.config import ConfigError
    from areal_flow.config_load import load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])
