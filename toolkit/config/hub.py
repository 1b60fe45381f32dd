"""The Hugging Face hub as a run reaches it: whether it can be reached at all, and `--push-to-hub`,
which uploads `final/` once the run has saved and checked it. A push that cannot happen (offline, no
token, the hub out of reach, a token the hub rejects) is refused before the model loads, not found
out after training. huggingface_hub is imported only when asked (flag parsing stays light)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from toolkit.errors import UserError

# huggingface_hub.utils._validators.REPO_ID_REGEX: an optional namespace, then a name of at most 96
REPO_ID = re.compile(r"(\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b")
_TRUE = ("1", "on", "yes", "true")


def repo_problems(repo: str) -> list[str]:
    """`--push-to-hub REPO`'s shape, as the hub checks a repo id (no network)."""
    if not repo:
        return []
    if not REPO_ID.fullmatch(repo) or "--" in repo or ".." in repo or repo.endswith(".git"):
        return [f"--push-to-hub {repo!r} is not a repo id: USER/NAME or NAME (letters, digits, '-', '_', '.'; "
                "at most 96 each)"]
    return []


def push_problem(repo: str, env: Mapping[str, str], token: str | None, unreachable: Callable[[], str | None],
                 whoami: Callable[[], Any]) -> str | None:
    """Why `--push-to-hub REPO` cannot upload from here, cheapest check first (the network only
    where the environment allows it): HF_HUB_OFFLINE, no token, the hub's host out of reach (one TCP
    connection), the token rejected (one whoami call). None: it can."""
    later = f"leave --push-to-hub out and upload OUTPUT_DIR/final later (hf upload {repo} OUTPUT_DIR/final)"
    offline = [k for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if env.get(k, "").lower() in _TRUE]
    if offline:
        return f"--push-to-hub {repo}: {offline[0]} is set, so nothing can be uploaded; unset it, or {later}"
    if not token:
        return (f"--push-to-hub {repo} needs a Hugging Face token with write access: log in with `hf auth login` "
                "or set HF_TOKEN")
    why = unreachable()
    if why:
        return f"--push-to-hub {repo}: the hub cannot be reached from here ({why}); {later}"
    try:
        whoami()
    except Exception as e:  # noqa: BLE001 - whatever the hub says, the upload would fail the same way
        status = getattr(getattr(e, "response", None), "status_code", None)
        said = "rejected the token" if status == 401 else f"did not answer ({type(e).__name__})"
        return f"--push-to-hub {repo}: the hub {said}; log in again with `hf auth login` or set HF_TOKEN"
    return None


def check_push(repo: str) -> None:
    """`push_problem` with this machine's environment, token and network; raises it as one line."""
    import huggingface_hub

    token = huggingface_hub.get_token()
    problem = push_problem(repo, os.environ, token, hub_unreachable,
                           lambda: huggingface_hub.HfApi().whoami(token=token))
    if problem:
        raise UserError(problem)


def push_final(api: Any | None, folder: Path, repo: str, private: bool) -> str:
    """Upload the checked `final/` folder to `repo` (created if missing; private if asked, else the
    hub's default for the account) through `api`, a huggingface_hub `HfApi` (None: a new one); returns the
    repo's URL. A failure is one line that says where the folder is and how to upload it by hand."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    try:
        url = api.create_repo(repo_id=repo, private=True if private else None, exist_ok=True)
        repo_id = getattr(url, "repo_id", None) or repo
        api.upload_folder(repo_id=repo_id, folder_path=str(folder),
                          commit_message=f"Upload {folder.name}/ of a toolkit run")
    except Exception as e:  # noqa: BLE001 - the run is saved: say so, and how to finish the upload
        raise UserError(f"--push-to-hub {repo}: the upload failed ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]}); the run is saved in {folder}: upload it with "
                        f"`hf upload {repo} {folder}`") from None
    return str(url) if isinstance(url, str) and url else f"https://huggingface.co/{repo_id}"


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub's host cannot be reached, from one TCP connection (None if it can). Asked before
    any hub call so a machine without network gets its one-line error at once rather than after
    huggingface_hub's five retries (~25 s). Behind a proxy the direct probe proves nothing: skipped."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"{host}:{port}: {e.strerror or type(e).__name__}"
    return None
