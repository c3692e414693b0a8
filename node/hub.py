"""Models from the Hugging Face Hub: ``hf://org/name[@revision]``, downloaded once into a cache.

``cadenza serve --model hf://HuggingFaceTB/SmolLM2-135M-Instruct@main`` downloads the repo's
serving files (config, safetensors, tokenizer, chat template; not ``.bin``, ``.gguf`` or ONNX
copies of the weights) with ``huggingface_hub`` into its cache (``$HF_HOME``, by default
``~/.cache/huggingface``), then serves that snapshot; a later start finds it there. The library's
own environment applies: ``HF_ENDPOINT`` for a mirror, ``HF_TOKEN`` for a gated or private repo,
``HF_HUB_OFFLINE=1`` to use only what is cached (how an engine pod starts after its init container
has downloaded the model: ``cadenza fetch-model hf://...``).

Source: huggingface_hub's ``snapshot_download`` (cache layout ``models--org--name/snapshots/<sha>``).
"""

from __future__ import annotations

import re
from pathlib import Path

SCHEME = "hf://"
# What cadenza loads from a model folder (runner/models): the rest of a repo is never read.
SERVING_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,254}$")


def is_hub(model: str | None) -> bool:
    return model is not None and model.startswith(SCHEME)


def parse(model: str) -> tuple[str, str]:
    """``(repo id, revision)`` of ``hf://org/name[@revision]`` (revision ``main`` when absent).

    Raises:
        ValueError: not of that form.
    """
    repo, _, revision = model.removeprefix(SCHEME).partition("@")
    revision = revision or "main"
    if not model.startswith(SCHEME) or not _REPO.match(repo) or not _REVISION.match(revision) or ".." in revision:
        raise ValueError(f"model: {model!r} is not hf://org/name[@revision]")
    return repo, revision


def fetch(model: str, cache_dir: Path | None = None) -> Path:
    """The local folder of ``hf://org/name[@revision]``, downloaded first when not cached.

    Raises:
        ValueError: a malformed reference.
        FileNotFoundError: the repo or revision does not exist, cannot be reached, or is not
            cached while ``HF_HUB_OFFLINE`` is set (the message says which and how to fix it).
    """
    repo, revision = parse(model)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache_dir, allow_patterns=list(SERVING_FILES)))
    except GatedRepoError:
        raise FileNotFoundError(f"model: {repo} is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"model: no repo {repo} on the Hub (or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(f"model: {repo}@{revision} is not cached and cannot be downloaded: {exc}") from None
    except (HfHubHTTPError, OSError) as exc:
        raise FileNotFoundError(f"model: cannot download {repo}@{revision}: {exc}") from None
