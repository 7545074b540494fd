"""Serve's direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``,
``harness/direct_ingress.py``), live: the Ingress replica serves HTTP on its
own port, no Serve proxy in the way, so kvroute's admission answers the
excess itself — OpenAI-style JSON 429 ``overloaded`` with ``Retry-After`` —
before any Ray call; admitted requests are served as through the proxy,
which still answers on ``http_options.port``.

Fails without the option: a plain app has no server on the direct port.
The harness's env is the one deploy/config.yaml documents (commented out)."""

from __future__ import annotations


import httpx
import pytest
import yaml

from harness.direct_ingress import INGRESS_ENV, DirectIngressApp
from harness.serving import REPO_ROOT
from tests.reliability.conftest import (
    ADMIT_TWO_ARGS, assert_burst_is_served_or_refused_as_json, post_with_key,
)


def test_the_documented_option_is_the_harness_env():
    lines = (REPO_ROOT / "deploy/config.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# runtime_env:")
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.strip().startswith("#   "):
            break
        block.append(line)
    indent = len(block[0]) - len(block[0].lstrip())
    documented = yaml.safe_load("\n".join(line[indent:].replace("# ", "", 1) for line in block))
    assert documented == {"runtime_env": {"env_vars": INGRESS_ENV}}


@pytest.fixture(scope="module")
def app(exclusive):
    app = DirectIngressApp(num_cpus=2, args_overrides=ADMIT_TWO_ARGS)
    with app:
        app.deploy()
        yield app


@pytest.mark.ray
def test_direct_port_serves_and_the_proxy_still_does(app):
    assert app.direct_port is not None and app.url != app.proxy_url
    body = {"prompt_token_ids": [40, 41, 42, 43], "max_new_tokens": 4, "ignore_eos": True}
    for url in (app.url, app.proxy_url):
        response = post_with_key(f"{url}/generate", body)
        assert response.status_code == 200, response.text
        assert len(response.json()["token_ids"]) == 4
    completion = post_with_key(f"{app.url}/v1/completions",
                               {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    # kvroute's auth, not Serve's: a bad key is the OpenAI-style 401
    bad = httpx.post(f"{app.url}/generate", json=body, headers={"Authorization": "Bearer nope"}, timeout=30,
                     trust_env=False)
    assert bad.status_code == 401 and "error" in bad.json()


@pytest.mark.ray
def test_direct_port_refuses_the_excess_with_kvroutes_json_and_retry_after(app):
    statuses = assert_burst_is_served_or_refused_as_json(app.url)
    print("FIGURES direct_ingress burst:", statuses)
