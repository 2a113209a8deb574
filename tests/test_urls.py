"""What a message may show of a URL: never a password, in any form the clients accept."""

from __future__ import annotations

import pytest

from elastic_ops.urls import scrubbed, shown_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg2://pool:hunter2@db:5432/pool", "postgresql+psycopg2://pool:***@db:5432/pool"),
        # SQLAlchemy takes these unencoded (a probe found them shown in full)
        ("postgresql+psycopg2://pool:se/cret@db:5432/pool", "postgresql+psycopg2://pool:***@db:5432/pool"),
        ("postgresql+psycopg2://pool:se?cret@db/pool", "postgresql+psycopg2://pool:***@db/pool"),
        ("postgresql+psycopg2://pool:se#cret@db/pool", "postgresql+psycopg2://pool:***@db/pool"),
        ("postgresql+psycopg2://pool:p@ss@db/pool", "postgresql+psycopg2://pool:***@db/pool"),
        ("redis://default:a/b@redis:6379/0", "redis://default:***@redis:6379/0"),
        ("redis://:r3d1s@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://u:pw@redis:6379/0?password=qs_secret", "rediss://u:***@redis:6379/0?password=***"),
        ("postgresql://pool@db/pool?sslmode=require&password=qs", "postgresql://pool@db/pool?sslmode=require&password=***"),
        ("unix:///run/redis.sock?db=0&PASSWORD=qs#x", "unix:///run/redis.sock?db=0&PASSWORD=***#x"),
        # libpq's key file password, and a password holding a newline (a probe found both shown)
        ("postgresql://pool@db/pool?sslpassword=kf&sslmode=verify-full", "postgresql://pool@db/pool?sslpassword=***&sslmode=verify-full"),
        ("postgresql://pool:pw\n2@db/pool", "postgresql://pool:***@db/pool"),
        # nothing to hide: shown as given
        ("postgresql://db.example:5432/pool", "postgresql://db.example:5432/pool"),
        ("sqlite:////var/lib/airflow/elastic_ops_pool.db", "sqlite:////var/lib/airflow/elastic_ops_pool.db"),
        ("s3://bucket/prefix", "s3://bucket/prefix"),
    ],
)
def test_no_password_is_shown(url, shown):
    assert shown_url(url) == shown


@pytest.mark.parametrize(
    ("url", "message"),
    [
        # a parser that ends the password at its first '@' takes the rest for the host
        ("postgresql://dbuser:p@ssword99@127.0.0.1:5432/test",
         'could not translate host name "ssword99@127.0.0.1" to address'),
        ("postgresql://u:hunter2@db/pool", "connection to db failed for u:hunter2"),
        ("postgresql://u@db/pool?password=qs_secret", "bad option password=qs_secret"),
        ("postgresql://u:hunter2%40x@db/pool", "authentication failed: hunter2@x"),  # decoded
    ],
)
def test_a_drivers_message_loses_the_urls_secrets(url, message):
    shown = scrubbed(message, url)
    assert all(secret not in shown for secret in ("ssword99", "hunter2", "qs_secret"))
    assert "***" in shown


def test_a_message_about_a_url_without_secrets_is_unchanged():
    assert scrubbed("could not connect to db:5432", "postgresql://pool@db:5432/pool") == (
        "could not connect to db:5432")
