"""Parsing and validation of ``actor_rollout_ref.rollout.custom.fastsync``."""

from __future__ import annotations

from typing import Any

import pytest

from verl_fastsync import plugins
from verl_fastsync.config import (
    FastsyncConfig,
    FastsyncConfigError,
    config_from_rollout,
    parse_fastsync_config,
    validate_names,
)

KEY = "actor_rollout_ref.rollout.custom.fastsync"


def test_absent_means_disabled_defaults() -> None:
    assert parse_fastsync_config(None) == FastsyncConfig()
    assert config_from_rollout({"custom": None}) == FastsyncConfig()
    assert config_from_rollout({}).enable is False
    assert FastsyncConfig().pre_resume_cleanup == "light" == FastsyncConfig().post_transfer_cleanup


def test_full_config() -> None:
    config = parse_fastsync_config(
        {
            "enable": True,
            "pre_resume_cleanup": "adaptive",
            "post_transfer_cleanup": "none",
            "adaptive_headroom_gib": 2,
            "disabled_plugins": ["a", "b"],
            "timeout_s": 30,
            "colocated_transport": "shm",
            "verify": True,
        }
    )
    assert config == FastsyncConfig(True, "adaptive", "none", 2.0, ("a", "b"), 30.0, "shm", True)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"enable": "yes"}, f"{KEY}.enable='yes' is invalid; allowed: true or false"),
        ({"enable": 1}, f"{KEY}.enable=1 is invalid; allowed: true or false"),
        ({"pre_resume_cleanup": ""}, f"{KEY}.pre_resume_cleanup='' is invalid; allowed: a non-empty name"),
        (
            {"post_transfer_cleanup": 3},
            f"{KEY}.post_transfer_cleanup=3 is invalid; allowed: a non-empty name",
        ),
        (
            {"adaptive_headroom_gib": -1},
            f"{KEY}.adaptive_headroom_gib=-1 is invalid; allowed: a finite number >= 0",
        ),
        ({"adaptive_headroom_gib": "4"}, "allowed: a finite number >= 0"),
        ({"timeout_s": 0}, f"{KEY}.timeout_s=0 is invalid; allowed: a finite number > 0"),
        ({"timeout_s": float("nan")}, "allowed: a finite number > 0"),
        ({"disabled_plugins": "abc"}, "allowed: a list of plugin names"),
        ({"disabled_plugins": ["ok", ""]}, "allowed: a list of non-empty plugin names"),
        ({"enabel": True}, f"{KEY}.enabel=True: unknown key; allowed keys: enable, pre_resume_cleanup"),
        (["enable"], f"{KEY}=['enable'] is invalid; allowed: a mapping"),
    ],
)
def test_bad_values_name_key_value_and_allowed(raw: Any, message: str) -> None:
    with pytest.raises(FastsyncConfigError) as info:
        parse_fastsync_config(raw)
    assert message in str(info.value)


def test_string_booleans_from_env_style_overrides() -> None:
    assert parse_fastsync_config({"enable": "True"}).enable is True


def test_omegaconf_input() -> None:
    from omegaconf import OmegaConf

    raw = OmegaConf.create({"custom": {"fastsync": {"enable": True, "disabled_plugins": ["x"]}}})
    assert config_from_rollout(raw) == FastsyncConfig(enable=True, disabled_plugins=("x",))


def test_validate_names_lists_available() -> None:
    pm = plugins.get_plugin_manager()
    validate_names(FastsyncConfig(enable=True, pre_resume_cleanup="aggressive"), pm)
    with pytest.raises(FastsyncConfigError) as info:
        validate_names(FastsyncConfig(enable=True, post_transfer_cleanup="fast"), pm)
    assert str(info.value) == (
        f"{KEY}.post_transfer_cleanup='fast': unknown cleanup policy; "
        "available: adaptive, aggressive, light, none"
    )
    with pytest.raises(FastsyncConfigError, match=r"colocated_transport='warp': unknown colocated transport"):
        validate_names(FastsyncConfig(enable=True, colocated_transport="warp"), pm)
