"""Model names as users give them: a local Hugging Face folder, or a hub id (`org/name`) resolved to one.

`--hf-checkpoint HuggingFaceTB/SmolLM2-135M-Instruct` works as in every peer:
`resolve_model_path` returns the folder of that repository's snapshot in
huggingface_hub's cache (`snapshot_download`: it downloads what is missing, or,
with `HF_HUB_OFFLINE=1`, only looks in the cache). A path that exists locally is
always taken as it is. `resolve_checkpoints(config)` does this for every model
folder of a run (`hf_checkpoint`, `critic_hf_checkpoint`, `ref_load`) before the
config is validated, so that every later check sees local folders.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.ppo.rollout.model_folder import missing_folder

if TYPE_CHECKING:
    from tandem.ppo.config.fields import RunFields

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""What a Hugging Face hub repository id looks like: `org/name` (one slash, no path beyond)."""

MODEL_FIELDS = ("hf_checkpoint", "critic_hf_checkpoint", "ref_load")
"""Config fields that name a Hugging Face model folder, and so may be given as hub ids."""

_WEIGHTS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
"""What a run needs of a hub repository: config, safetensors weights, tokenizer and chat template files."""


def looks_like_hub_id(name: str) -> bool:
    """Whether `name` has the form of a hub repository id (`org/name`)."""
    return bool(HUB_ID.match(name)) and not name.startswith((".", "/"))


def resolve_model_path(name: str, *, flag: str = "--hf-checkpoint") -> str:
    """A local folder for `name`: the path itself if it exists, else the hub snapshot of repository `name`.

    A name that is a path (`./x`, `/x`, `a/b/c`, or `org/name` where `org/` is a local folder) is never
    looked up on the hub: it is returned as it is, for the folder checks to say "folder missing"
    (`missing_folder`). Raises ValueError naming `flag`, "folder missing" first, when an id-like `name`
    is neither an existing path nor a repository id that the hub (or, offline, its cache) has.
    """
    if not name or Path(name).exists() or not looks_like_hub_id(name) or Path(name.split("/", 1)[0]).is_dir():
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return str(snapshot_download(repo_id=name, allow_patterns=_WEIGHTS))
    except LocalEntryNotFoundError:
        raise missing_folder(
            name,
            flag,
            hub=(
                "the Hugging Face cache has no snapshot of it (offline: HF_HUB_OFFLINE=1, or the hub could "
                "not be reached)",
                "download it once with the hub reachable",
            ),
        ) from None
    except RepositoryNotFoundError:
        raise missing_folder(
            name,
            flag,
            hub=(
                "the Hugging Face hub has no such repository",
                "fix it (a private one needs `hf auth login`)",
            ),
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise ValueError(
            f"{flag}: {name!r} is no local folder and could not be downloaded from the Hugging Face hub ({exc})"
        ) from None


def resolve_checkpoints[C: RunFields](config: C) -> C:
    """`config` with each model field (`MODEL_FIELDS`) that is a hub id replaced by its local snapshot folder."""
    changes: dict[str, Any] = {}
    for name in MODEL_FIELDS:
        value = getattr(config, name, None)
        if value:
            resolved = resolve_model_path(value, flag="--" + name.replace("_", "-"))
            if resolved != value:
                changes[name] = resolved
    return dataclasses.replace(config, **changes) if changes else config
