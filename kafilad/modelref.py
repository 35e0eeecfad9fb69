"""Models by name: `kafila-ctl host --model ORG/NAME[@REVISION]` (issue 10 "Models by name").

The host's daemon resolves a Hugging Face repo id to a local directory with `huggingface_hub`
(the daemon, not kafila-ctl: the two may run as different users, and the files must be where the
daemon reads them):

1. A local path (absolute, `~`, `.`-relative, or any path that exists) is returned as given;
   HostSession then checks it holds a model.
2. A repo id is looked up in the daemon's Hugging Face cache (`HF_HUB_CACHE`, default
   ~/.cache/huggingface/hub; layout `models--ORG--NAME/{refs/REV, snapshots/COMMIT/FILE}`) and used
   from there when the snapshot holds every file serving needs.
3. Otherwise, when online, only those files are downloaded (MODEL_FILE_PATTERNS: configs,
   safetensors weights, tokenizer files; no code, no other weight formats) into that cache.
4. Offline (`HF_HUB_OFFLINE=1`) and absent: a sentence saying so and what to do.

GGUF files (issue 21 item 5): `--model FILE.gguf`, or `--model ollama:NAME[:TAG]` for a model in
Ollama's store (`$OLLAMA_MODELS`, default ~/.ollama/models: the manifest
`manifests/registry.ollama.ai/library/NAME/TAG` (NAMESPACE/NAME for others' models, tag `latest`
by default) names the model layer `application/vnd.ollama.image.model` by digest, the file being
`blobs/sha256-HEX`). The daemon converts the file once into an mlx-lm model directory under its
state directory (`models/gguf-<identity>`, kafilad/executor/gguf.py), keyed by the file's path,
size and modification time, and serves that directory.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import trio

from kafilad.errors import KafilaError

#: Hugging Face repo ids: ORG/NAME, each 1-96 of [A-Za-z0-9._-], not starting with '.' or '-'
#: (huggingface_hub utils/_validators.py), optionally @REVISION (branch, tag or commit).
REPO_ID_RE = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})"
                        r"(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]{0,199}))?")
#: what serving reads (mlx-lm's own download list, without *.py: no remote code)
MODEL_FILE_PATTERNS = ["*.json", "model*.safetensors", "tokenizer.model", "*.tiktoken", "tiktoken.model",
                       "*.txt", "*.jsonl", "*.jinja"]


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, read now (huggingface_hub reads it at import)."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process uses, read from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def parse_repo_id(ref: str) -> Optional[tuple[str, Optional[str]]]:
    """(repo id, revision or None) when `ref` names a Hugging Face repo rather than a local path.

    A string that exists as a path, starts with '/', '~' or '.', or does not have the ORG/NAME
    form is a path (None).
    """
    if not ref or ref[0] in "/~." or os.path.exists(ref):
        return None
    m = REPO_ID_RE.fullmatch(ref)
    if m is None:
        return None
    return m.group("repo"), m.group("revision")


def missing_model_files(model_dir: Path) -> list[str]:
    """Files serving needs that `model_dir` lacks: config.json, a tokenizer, the safetensors weights
    (every shard the index names, or at least one *.safetensors)."""
    missing = [] if (model_dir / "config.json").is_file() else ["config.json"]
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tiktoken.model")) \
            and not list(model_dir.glob("*.tiktoken")):
        missing.append("tokenizer.json")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return missing + ["model.safetensors.index.json (unreadable)"]
        missing += [s for s in shards if not (model_dir / s).is_file()]
    elif not list(model_dir.glob("*.safetensors")):
        missing.append("model.safetensors")
    return missing


#: `--model ollama:NAME[:TAG]`
OLLAMA_PREFIX = "ollama:"
#: the media type of the model layer in an Ollama manifest
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_OLLAMA_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9][A-Za-z0-9._-]{0,127})?")
_OLLAMA_TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def ollama_models_dir() -> Path:
    """Ollama's model store: $OLLAMA_MODELS, else ~/.ollama/models (read from the environment now)."""
    env = os.environ.get("OLLAMA_MODELS", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def resolve_ollama(ref: str) -> Path:
    """The GGUF blob of `ollama:NAME[:TAG]` in Ollama's store (module docstring).

    Raises:
        KafilaError: a malformed name, or a store, manifest or blob that is not there, saying
            what was looked for and where.
    """
    spec = ref[len(OLLAMA_PREFIX):]
    name, _, tag = spec.partition(":")
    tag = tag or "latest"
    if not _OLLAMA_NAME_RE.fullmatch(name) or not _OLLAMA_TAG_RE.fullmatch(tag):
        raise KafilaError(f"{ref!r} is not an Ollama model name: give ollama:NAME or ollama:NAME:TAG, as "
                          "`ollama list` shows them (e.g. ollama:smollm2:135m).")
    store = ollama_models_dir()
    if not store.is_dir():
        raise KafilaError(f"There is no Ollama model store at {store} (set OLLAMA_MODELS to where `ollama pull` keeps "
                          "models, for the user this daemon runs as).")
    path = "library/" + name if "/" not in name else name
    manifest = store / "manifests" / "registry.ollama.ai" / path / tag
    try:
        doc = json.loads(manifest.read_text())
    except FileNotFoundError:
        raise KafilaError(f"Ollama's store at {store} has no model {name}:{tag} (no manifest {manifest}); `ollama pull "
                          f"{name}:{tag}` fetches it.") from None
    except (OSError, ValueError) as e:
        raise KafilaError(f"The Ollama manifest {manifest} cannot be read ({e}).") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    digest = next((layer.get("digest") for layer in layers or () if isinstance(layer, dict)
                   and layer.get("mediaType") == OLLAMA_MODEL_LAYER), None)
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise KafilaError(f"The Ollama manifest {manifest} names no model layer ({OLLAMA_MODEL_LAYER}).")
    blob = store / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise KafilaError(f"Ollama's manifest for {name}:{tag} names {digest}, but {blob} is not there; `ollama pull "
                          f"{name}:{tag}` fetches it again.")
    return blob


def is_gguf_ref(ref: str) -> bool:
    """`ref` names a GGUF file: ollama:NAME[:TAG], or a path ending in .gguf."""
    return ref.startswith(OLLAMA_PREFIX) or ref.lower().endswith(".gguf")


def converted_gguf(path: Path, models_dir: Path) -> Path:
    """The mlx-lm model directory of GGUF file `path`, converted once into `models_dir`
    (kafilad/executor/gguf.py) and reused while the file's path, size and mtime stay the same.
    Blocking (reads the whole file the first time).

    Raises:
        KafilaError: the file is not there. ModelFormatError: as `convert_gguf`.
    """
    import hashlib
    import shutil
    import tempfile

    try:
        st = path.stat()
    except OSError as e:
        raise KafilaError(f"The GGUF file {path} cannot be read ({e.strerror or e}).") from None
    from kafilad.node.serving.stagehost import executor  # only kafilad.executor imports mlx

    ident = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0"
                           f"{executor().gguf.CONVERSION_VERSION}".encode()).hexdigest()[:16]
    out = models_dir / f"gguf-{path.stem[:48]}-{ident}"
    if (out / "kafila-gguf.json").is_file():
        return out
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=models_dir))
    try:
        executor().gguf.convert_gguf(path, tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model_ref(ref: str, models_dir: Optional[Path] = None) -> str:
    """The local model directory for `ref`: a path as given, a GGUF file or Ollama model converted
    into `models_dir`, or a repo id resolved as the module docstring says. Blocking (it may
    download or convert); `resolve_model_dir` runs it off the trio thread.

    Raises:
        KafilaError: a repo id that is neither cached nor downloadable, an Ollama model or GGUF
            file that is not there, with the reason. ModelFormatError: a GGUF file Kafila cannot read.
    """
    if is_gguf_ref(ref):
        path = resolve_ollama(ref) if ref.startswith(OLLAMA_PREFIX) else Path(ref).expanduser()
        if models_dir is None:
            raise KafilaError("GGUF models are converted into the daemon's state directory; this caller gave none.")
        return str(converted_gguf(path, models_dir))
    parsed = parse_repo_id(ref)
    if parsed is None:
        return ref
    repo_id, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cache = hub_cache_dir()
    name = repo_id + (f"@{revision}" if revision else "")
    kw = dict(repo_id=repo_id, revision=revision, cache_dir=str(cache), allow_patterns=MODEL_FILE_PATTERNS)
    cached_missing: list[str] = []
    try:
        path = Path(snapshot_download(local_files_only=True, **kw))
        cached_missing = missing_model_files(path)
        if not cached_missing:
            return str(path)
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    if is_offline():
        held = f" (its snapshot there lacks {', '.join(cached_missing)})" if cached_missing else ""
        raise KafilaError(
            f"The model {name} is not in this daemon's Hugging Face cache at {cache}{held}, and HF_HUB_OFFLINE "
            f"is set, so it cannot be downloaded: download it where there is a network (`hf download {repo_id}`) "
            f"into that cache, or pass a model directory.")
    try:
        path = Path(snapshot_download(**kw))
    except GatedRepoError as e:
        raise KafilaError(f"The model {name} is gated on Hugging Face: accept its terms on huggingface.co and give "
                          f"this daemon a token (HF_TOKEN) ({e.__class__.__name__}).") from e
    except RepositoryNotFoundError as e:
        raise KafilaError(f"There is no model {repo_id} on Hugging Face, or it is private (a private repo needs "
                          f"HF_TOKEN in this daemon's environment).") from e
    except RevisionNotFoundError as e:
        raise KafilaError(f"The model {repo_id} has no revision {revision!r} on Hugging Face.") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise KafilaError(f"The model {name} is not in this daemon's Hugging Face cache at {cache} and could not "
                          f"be downloaded: {download_failure(e)}") from e
    missing = missing_model_files(path)
    if missing:
        raise KafilaError(f"The Hugging Face repo {name} lacks files serving needs: {', '.join(missing)} "
                          f"(kafila serves safetensors models in the Hugging Face / mlx-community layout).")
    return str(path)


def download_failure(e: BaseException) -> str:
    """One line saying why a download failed: huggingface_hub's own messages run to several lines
    and wrap the cause ("Got: ConnectError: ... An error happened while trying to locate the files
    on the Hub, ..."); the innermost exception of the chain says it in its own words."""
    root, seen = e, set()
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        seen.add(id(root))
        root = nxt
    detail = " ".join(str(root).split()) or type(root).__name__
    if root is not e and isinstance(root, OSError) and not isinstance(root, FileNotFoundError):
        return (f"the Hugging Face Hub could not be reached ({detail}); check this machine's network, or download "
                f"the model where there is one and pass its directory.")
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return first if first.endswith(".") else first + "."


async def resolve_model_dir(ref: str, models_dir: Optional[Path] = None) -> str:
    """`resolve_model_ref` on a worker thread, so a download or a GGUF conversion does not stall
    the daemon.

    Raises:
        KafilaError: as `resolve_model_ref`.
    """
    if parse_repo_id(ref) is None and not is_gguf_ref(ref):
        return ref
    return await trio.to_thread.run_sync(resolve_model_ref, ref, models_dir, abandon_on_cancel=True)
