"""Redis URLs are shown without their password: in logs, errors and the tier config's repr."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.tiers import TierConfig
from pagedkv.tiers.urls import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
        ("redis://pw@h/0", "redis://***@h/0"),
        ("redis://u:p@ss@h:1", "redis://u:***@h:1"),
        ("redis://h/0?password=pw&db=1", "redis://h/0?password=***&db=1"),
        ("unix:///tmp/r.sock", "unix:///tmp/r.sock"),
        ("rediss+cluster://a:b@h:7000", "rediss+cluster://a:***@h:7000"),
    ],
)
def test_redact_url_hides_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_tier_config_repr_and_url_errors_hide_the_password() -> None:
    cfg = TierConfig(redis_url="redis://default:s3cret@127.0.0.1:1/0")
    assert "s3cret" not in repr(cfg)
    from pagedkv.tiers.redis_tier import make_client

    with pytest.raises(InvalidRequestError) as info:
        make_client("memcached://u:s3cret@h:1", 0.1, 0.1)
    assert "s3cret" not in str(info.value)
    assert "***" in str(info.value)
