"""Every Kafka client gets the short metadata refresh, the retry and timeout settings, and the
optional SASL/SSL security of :class:`shared.config.KafkaConfig` (``shared.kafka.client_options``).

Before the fix the clients kept aiokafka's 5-minute metadata refresh (300,000 ms), which left the services
blind to a restarted broker's topics for minutes, and no security setting existed.
"""

from __future__ import annotations

import ssl
import subprocess

import pytest
from pydantic import ValidationError

from shared import kafka
from shared.config import KafkaConfig


async def test_producer_consumer_and_admin_get_the_short_metadata_refresh_and_timeouts():
    cfg = KafkaConfig(metadata_max_age_ms=5000, request_timeout_ms=12000, retry_backoff_ms=300)
    producer = kafka.make_producer(cfg)
    consumer = kafka.make_consumer(cfg, "t", group_id=None)
    admin = kafka.make_admin(cfg)
    for client in (producer.client, consumer._client, admin._client):
        assert client._metadata_max_age_ms == 5000
        assert client._request_timeout_ms == 12000
        assert client._retry_backoff == pytest.approx(0.3)
    assert KafkaConfig().metadata_max_age_ms == 5000  # the default, not aiokafka's 300,000


def test_sasl_reads_the_password_from_its_file_and_never_shows_it(tmp_path):
    secret = tmp_path / "kafka_password"
    secret.write_text("s3cret-pw\n")
    cfg = KafkaConfig(security_protocol="SASL_PLAINTEXT", sasl_plain_username="flywheel",
                      sasl_plain_password_file=str(secret))
    opts = kafka.client_options(cfg)
    assert opts["security_protocol"] == "SASL_PLAINTEXT" and opts["sasl_mechanism"] == "PLAIN"
    assert opts["sasl_plain_username"] == "flywheel" and opts["sasl_plain_password"] == "s3cret-pw"
    direct = KafkaConfig(security_protocol="SASL_PLAINTEXT", sasl_plain_username="u", sasl_plain_password="hunter22")
    assert kafka.client_options(direct)["sasl_plain_password"] == "hunter22"
    assert "hunter22" not in repr(direct) and "hunter22" not in str(direct.model_dump())
    with pytest.raises(ValidationError, match="sasl_plain_username"):
        KafkaConfig(security_protocol="SASL_SSL")
    with pytest.raises(ValidationError, match="ssl_keyfile"):
        KafkaConfig(security_protocol="SSL", ssl_certfile="/x.pem")
    with pytest.raises(ValidationError):
        KafkaConfig(security_protocol="KERBEROS")


def test_ssl_builds_a_context_with_the_ca_and_the_client_certificate(tmp_path):
    key, cert = tmp_path / "client.key", tmp_path / "client.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=flywheel-test"], check=True, capture_output=True)
    cfg = KafkaConfig(security_protocol="SSL", ssl_cafile=str(cert), ssl_certfile=str(cert), ssl_keyfile=str(key))
    opts = kafka.client_options(cfg)
    ctx = opts["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    assert opts["security_protocol"] == "SSL" and "sasl_plain_password" not in opts
    assert "ssl_context" not in kafka.client_options(KafkaConfig())  # PLAINTEXT: none
