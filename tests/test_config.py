"""Parsing and validation of ``actor_rollout_ref.rollout.custom.fastsync``."""

from __future__ import annotations

from typing import Any

import pytest

from verl_fastsync import config, plugins, selection
from verl_fastsync.config import (
    FastsyncConfig,
    FastsyncConfigError,
    config_from_rollout,
    parse_fastsync_config,
)
from verl_fastsync.selection import validate_names

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


# -- the one rule of each size and timeout ------------------------------------------------------


@pytest.mark.parametrize("good", [1, 0.5, 600.0])
def test_validate_timeout_accepts_finite_positive_numbers(good: float) -> None:
    assert config.validate_timeout(good) == float(good)
    assert isinstance(config.validate_timeout(good), float)


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ("soon", TypeError, "t must be a number of seconds, got 'soon'"),
        (True, TypeError, "t must be a number of seconds, got True"),
        (None, TypeError, "t must be a number of seconds, got None"),
        (0, ValueError, "t must be a finite number > 0 of seconds, got 0"),
        (-1.5, ValueError, "t must be a finite number > 0 of seconds, got -1.5"),
        (float("nan"), ValueError, "t must be a finite number > 0 of seconds, got nan"),
        (float("inf"), ValueError, "t must be a finite number > 0 of seconds, got inf"),
    ],
)
def test_validate_timeout_rejects(bad: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        config.validate_timeout(bad, "t")
    assert str(info.value) == message


def test_validate_bucket_size_bytes_and_mib() -> None:
    assert config.validate_bucket_size(1) == 1
    assert config.validate_bucket_size(0.5, mib=True) == 1 << 19
    assert config.validate_bucket_size(2, "bucket_size_mb", mib=True) == 2 << 20
    for bad, error in (
        (0, ValueError),
        (-3, ValueError),
        (1.0, TypeError),
        (True, TypeError),
        ("8", TypeError),
    ):
        with pytest.raises(error, match="bucket_size must be a positive"):
            config.validate_bucket_size(bad)
    # MiB: anything but a finite number that comes to at least one byte, including 1e-9 MiB (0 bytes)
    for bad in (0, -1, 1e-9, float("nan"), float("inf"), "64", True, None):
        with pytest.raises(ValueError, match=r"bucket_size_mb must be a positive number of MiB, got"):
            config.validate_bucket_size(bad, "bucket_size_mb", mib=True)


def test_timeout_from_env() -> None:
    assert config.timeout_from_env(None) is None and config.timeout_from_env("  ") is None
    assert config.timeout_from_env("30") == 30.0
    with pytest.raises(
        ValueError, match=r"VERL_FASTSYNC_COLOCATED_TIMEOUT_S='soon' must be a positive number"
    ):
        config.timeout_from_env("soon")
    with pytest.raises(ValueError, match=r"X='-1' must be a finite number > 0 of seconds"):
        config.timeout_from_env("-1", "X")


def test_each_rule_and_constant_is_defined_once() -> None:
    from verl_fastsync import chunks, colocated
    from verl_fastsync.chunks import meta
    from verl_fastsync.colocated import protocol
    from verl_fastsync.transports import base
    from verl_fastsync.verl import startup

    assert chunks.validate_bucket_size is meta.validate_bucket_size is config.validate_bucket_size
    assert base.DEFAULT_TIMEOUT_S is colocated.DEFAULT_TIMEOUT_S is config.DEFAULT_TIMEOUT_S == 600.0
    assert config.DEFAULT_ENGINE_TIMEOUT_S is config.DEFAULT_TIMEOUT_S
    assert startup.OFF is protocol._OFF is config.COLOCATED_OFF


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "30", True])
def test_every_timeout_goes_through_the_rule(bad: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_fastsync.colocated import protocol
    from verl_fastsync.transports import base

    seen: list[object] = []

    def spy(value: object, what: str = "timeout_s") -> float:
        seen.append(value)
        return real(value, what)

    real = config.validate_timeout
    monkeypatch.setattr(config, "validate_timeout", spy)
    monkeypatch.setattr(base, "validate_timeout", spy)  # imported by name (the identity is checked above)
    with pytest.raises(
        FastsyncConfigError, match=f"{KEY}.timeout_s=.* is invalid; allowed: a finite number > 0"
    ):
        parse_fastsync_config({"timeout_s": bad})
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0 of seconds"):
        selection.parse_engine_kwargs({"timeout_s": bad}, plugins.get_plugin_manager())
    with pytest.raises(ValueError, match="timeout_s must be a"):
        protocol._check_timeout(bad)
    with pytest.raises((TypeError, ValueError), match="timeout_s must be a"):
        base.TransportOptions(timeout_s=bad)
    assert len(seen) == 4


@pytest.mark.parametrize("bad", [1, 5, "three", True, 2.5])
def test_shm_slots_are_validated_with_what_is_allowed(bad: Any) -> None:
    with pytest.raises(
        ValueError, match=r"engine_kwargs\.fastsync\.slots=.* is invalid; allowed: an integer from 2 to 4"
    ):
        selection.parse_engine_kwargs({"transport": "shm", "slots": bad}, plugins.get_plugin_manager())


def test_shm_slots_default_and_override_and_only_for_shm() -> None:
    from verl_fastsync.transports.base import TransportOptions
    from verl_fastsync.transports.shm import DEFAULT_SLOTS, ShmTransport

    settings = selection.parse_engine_kwargs({"transport": "shm", "slots": "4"}, plugins.get_plugin_manager())
    assert settings.extra == {"slots": 4}
    assert ShmTransport(TransportOptions(extra=settings.extra)).slots == 4
    assert ShmTransport(TransportOptions()).slots == DEFAULT_SLOTS == 3
    with pytest.raises(ValueError, match=r"unknown engine_kwargs\.fastsync key\(s\) \['slots'\]"):
        selection.parse_engine_kwargs({"transport": "gloo", "slots": 3}, plugins.get_plugin_manager())


def test_hosts_is_auto_or_off() -> None:
    pm = plugins.get_plugin_manager()
    assert selection.parse_engine_kwargs({"transport": "nixl"}, pm).hosts == "auto"
    assert selection.parse_engine_kwargs({"transport": "gloo", "hosts": "OFF"}, pm).hosts == "off"
    assert (
        selection.parse_engine_kwargs({"transport": "gloo", "hosts": False}, pm).hosts == "off"
    )  # YAML's off
    with pytest.raises(config.EngineKwargsError, match=r"hosts='ring' is invalid; allowed: auto .* or off"):
        selection.parse_engine_kwargs({"transport": "gloo", "hosts": "ring"}, pm)
