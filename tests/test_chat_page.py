"""The chat page of ``mlx-mtp serve`` (``GET /``) in a real headless Chromium (the
distribution's, driven by Playwright): a message sent streams a reply whose tokens
are coloured by where they came from, with tokens per pass under it; the page needs
no key itself (the Host and Origin checks hold) and sends the one it is given.
Skipped where Chromium or Playwright is missing; ``python -m pytest -m slow`` runs
it. The HTTP side is checked without a browser too."""

import http.client
import shutil

import pytest

from mlx_mtp.server import Server, server_args

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def served(checkpoint):
    path = str(checkpoint("qwen3_5", predictable=True))
    args = server_args(model=path, port=0, api_key=["k1"], num_draft_tokens=3)
    server = Server(args).start()
    yield server
    server.close()


def get(server, path, host=None):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {"Host": host} if host else {}
    connection.request("GET", path, headers=headers)
    response = connection.getresponse()
    return response.status, dict(response.getheaders()), response.read()


def test_the_page_is_served_without_a_key_and_offline(served):
    status, headers, body = get(served, "/")
    assert status == 200 and headers["Content-type"].startswith("text/html")
    assert "connect-src 'self'" in headers["Content-Security-Policy"]
    assert b"mtp_sources" in body and b"http" not in body.split(b"<script>")[1]
    assert get(served, "/v1/models")[0] == 401  # the API still needs the key
    assert get(served, "/", host="evil.example")[0] == 403


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine")
def test_a_message_streams_coloured_tokens(served, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(served.url + "/")
            page.fill("#key", "k1")
            page.dispatch_event("#key", "change")
            page.fill("#prompt", "Write a function.")
            page.click("#send")
            page.wait_for_selector(".assistant .meta", timeout=60000)
            reply = page.inner_text(".assistant")
            drafted = page.locator(".assistant span.heads").count()
            meta = page.inner_text(".assistant .meta")
            page.screenshot(path=str(tmp_path / "chat-page.png"))
        finally:
            browser.close()
    assert "error" not in meta and "tokens per pass" in meta
    assert drafted > 0  # accepted drafts, coloured as the heads'
    assert len(reply) > len("tokens per pass")
