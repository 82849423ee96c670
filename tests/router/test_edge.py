"""pd-router as the edge: HTTPS on its listener (a self-signed certificate made here with the
`cryptography` package) and client API keys from a file and PD_ROUTER_API_KEYS."""

import datetime
import ipaddress
import time

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.router_harness import RouterProcess
from tests.router.conftest import FAST_HEALTH, LONG_PROMPT, deployment, mocks

BODY = {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 3}
FILE_KEY, ENV_KEY = "key-from-file-0123456789", "key-from-env-9876543210"


def self_signed(directory) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pd-router test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "router.crt", directory / "router.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return str(cert_path), str(key_path)


def wait_https(url: str, cert: str, router: RouterProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert router.proc.poll() is None, router.log_tail()
        try:
            if requests.get(url + "/ready", verify=cert, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(router.log_tail())


def test_https_listener_with_api_keys(tmp_path):
    cert, key = self_signed(tmp_path)
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"# one key per line\n{FILE_KEY}\n\n")
    prefills, decodes = mocks()
    router = RouterProcess("router-tls", prefill=[p.worker_arg() for p in prefills],
                           decode=[d.worker_arg() for d in decodes],
                           args=("--log-format", "text", "--tls-cert", cert, "--tls-key", key,
                                 "--api-key-file", str(key_file)),
                           config={"health": FAST_HEALTH}, env={"PD_ROUTER_API_KEYS": f" {ENV_KEY} ,"})
    https = f"https://127.0.0.1:{router.port}"
    try:
        start_all([*prefills, *decodes], timeout=60)
        router.start()
        wait_https(https, cert, router)
        for api_key in (FILE_KEY, ENV_KEY):
            resp = requests.post(https + "/v1/completions", json=BODY, verify=cert, timeout=15,
                                 headers={"Authorization": f"Bearer {api_key}"})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"], resp.text
        served = decodes[0].stats()["requests"]
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": FILE_KEY},
                        {"Authorization": f"Basic {FILE_KEY}"}, {"Authorization": f"Bearer {FILE_KEY}x"}):
            refused = requests.post(https + "/v1/completions", json=BODY, verify=cert, timeout=15,
                                    headers=headers)
            assert refused.status_code == 401, (headers, refused.text)
            assert refused.headers["WWW-Authenticate"].startswith("Bearer")
            assert "API key" in refused.json()["error"]["message"]
        assert requests.get(https + "/v1/models", verify=cert, timeout=5).status_code == 401
        assert decodes[0].stats()["requests"] == served  # refused before any engine
        # probes and the scraper need no key (metrics_need_api_key is off)
        assert requests.get(https + "/health", verify=cert, timeout=5).status_code == 200
        assert requests.get(https + "/metrics", verify=cert, timeout=5).status_code == 200
        # the listener speaks only TLS
        with pytest.raises(requests.RequestException):
            requests.get(f"http://127.0.0.1:{router.port}/health", timeout=5).raise_for_status()
    finally:
        for proc in [router, *prefills, *decodes]:
            proc.stop(grace=5)


def test_metrics_behind_the_api_keys_when_configured():
    prefills, decodes = mocks()
    with deployment(prefills, decodes, config={"metrics_need_api_key": True},
                    env={"PD_ROUTER_API_KEYS": ENV_KEY}) as router:
        assert requests.get(router.url + "/metrics", timeout=5).status_code == 401
        metrics = requests.get(router.url + "/metrics", timeout=5,
                               headers={"Authorization": f"Bearer {ENV_KEY}"})
        assert metrics.status_code == 200 and "pd_router_worker_healthy" in metrics.text
        assert requests.get(router.url + "/ready", timeout=5).status_code == 200


def test_without_keys_the_api_is_open():
    prefills, decodes = mocks()
    with deployment(prefills, decodes) as router:
        assert requests.post(router.url + "/v1/completions", json=BODY, timeout=15).status_code == 200
