"""mesh.config.load_config: flags > CACHE_SVC-style env > defaults, typed and validated by msgspec."""

from __future__ import annotations

from typing import Annotated

import msgspec
import pytest

from cache_svc.config import ENV_PREFIX, CacheConfig
from mesh.config import config_dict, load_config


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """A service's settings.

    max_batch: how many requests share a step
    name: what the service calls itself
    ratio: share of the batch kept, e.g. 0.5 = 50 %
    """

    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 8
    ratio: float = 0.5
    name: str = "svc"
    verbose: bool = False
    tags: list[str] = []
    ports: list[int] = []
    limit: int | None = None
    api_key: str = ""
    max_tokens: int = 256


def test_defaults_env_and_flags_in_order_of_precedence() -> None:
    assert load_config(Settings, [], env_prefix="X", environ={}) == Settings()
    env = {"X_MAX_BATCH": "16", "X_NAME": "from-env", "X_RATIO": "0.25"}
    cfg = load_config(Settings, ["--name", "from-flag"], env_prefix="X", environ=env)
    assert (cfg.max_batch, cfg.name, cfg.ratio) == (16, "from-flag", 0.25)
    assert load_config(Settings, [], env_prefix="Y", environ=env) == Settings()  # another prefix


def test_bools_lists_and_optionals() -> None:
    cfg = load_config(
        Settings, ["--verbose", "--tags", "a,b,,c", "--limit", "3"], env_prefix="X", environ={"X_PORTS": "80, 443"}
    )
    assert (cfg.verbose, cfg.tags, cfg.ports, cfg.limit) == (True, ["a", "b", "c"], [80, 443], 3)
    assert load_config(Settings, ["--no-verbose"], env_prefix="X", environ={"X_VERBOSE": "yes"}).verbose is False
    assert load_config(Settings, [], env_prefix="X", environ={"X_VERBOSE": "on"}).verbose is True


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--max-batch", "many"], {}, "--max-batch / X_MAX_BATCH"),
        ([], {"X_VERBOSE": "maybe"}, "not a boolean"),
        (["--max-batch", "0"], {}, "invalid configuration"),
        (["--unknown", "1"], {}, "unrecognized arguments"),
    ],
)
def test_bad_values_exit_2_naming_the_setting(
    argv: list[str], environ: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        load_config(Settings, argv, env_prefix="X", environ=environ)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_help_shows_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_config(Settings, ["--help"], env_prefix="X", environ={})
    out = " ".join(capsys.readouterr().out.split())
    assert "how many requests share a step (default 8)" in out
    assert "e.g. 0.5 = 50 % (default 0.5)" in out  # a % in a description is printed, not %-formatted


def test_config_dict_masks_secrets() -> None:
    assert config_dict(Settings(api_key="sk-123"))["api_key"] == "***"
    assert config_dict(Settings())["api_key"] == ""
    assert config_dict(Settings(name="n"))["name"] == "n"
    assert config_dict(Settings())["max_tokens"] == 256  # a count of tokens is not a secret


def test_cache_service_flags_of_the_contract() -> None:
    argv = "--host 0.0.0.0 --port 7001 --data-dir /data --dram-bytes 1 --ssd-bytes 2 --retention-hours 3"
    argv += " --record-bytes 4 --record-ttl-s 5 --metrics-port 9101 --log-level debug"
    cfg = load_config(CacheConfig, argv.split(), env_prefix=ENV_PREFIX, environ={"CACHE_SVC_SSD_BYTES": "99"})
    assert (cfg.host, cfg.port, cfg.data_dir, cfg.metrics_port, cfg.log_level) == (
        "0.0.0.0",
        7001,
        "/data",
        9101,
        "debug",
    )
    assert (cfg.dram_bytes, cfg.ssd_bytes, cfg.retention_hours, cfg.record_bytes, cfg.record_ttl_s) == (1, 2, 3, 4, 5)
    from_env = load_config(
        CacheConfig, [], env_prefix=ENV_PREFIX, environ={"CACHE_SVC_DATA_DIR": "/d", "CACHE_SVC_RETENTION_HOURS": "1.5"}
    )
    assert (from_env.data_dir, from_env.retention_hours, from_env.port) == ("/d", 1.5, 7001)
