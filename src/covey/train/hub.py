"""Pushing a run to the Hugging Face Hub under push_to_hub, as transformers' Trainer does.

The repo is ``hub_model_id`` (by default output_dir's folder name, in the token's namespace), on the
branch ``hub_revision``; ``hub_strategy`` says what goes up, and when:

    end              the final model with its model card (final_model/), once training is over
    every_save       that, and the model of each checkpoint as it is saved, at the repo's top
    checkpoint       that, and the newest checkpoint whole as last-checkpoint/ (to resume elsewhere)
    all_checkpoints  that, and every checkpoint whole in a folder of its name

Everything is checked before any model is loaded: the Hub not switched off (HF_HUB_OFFLINE), a
token that it accepts and that may write, the repo (created when missing) and the branch.
Checkpoints upload in a thread of their own, one push after the other, while training goes on; each
from hard links to its files, so that save_total_limit may delete the checkpoint meanwhile. A
checkpoint saved while the previous push is still uploading is not pushed, unless hub_always_push
queues it. The final push waits for those, then uploads final_model/.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from covey.config import GRPOConfig
from covey.errors import HubError
from covey.train.distributed import World

STAGING = ".hub-push-"  # the run folder's hard-linked copies of checkpoints on their way up

def hub_offline() -> bool:
    """Whether the Hub is switched off: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set now, or when
    huggingface_hub was imported (which then refuses every request)."""
    from huggingface_hub import constants

    now = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
    return constants.HF_HUB_OFFLINE or now in ("1", "ON", "YES", "TRUE")


class HubPush:
    """The pushes of one run to its repo (made by ``connect``)."""

    def __init__(self, api: Any, repo_id: str, url: str, args: GRPOConfig, token: str, run_dir: Path):
        self.api, self.repo_id, self.url, self.token, self.run_dir = api, repo_id, url, token, run_dir
        self.strategy, self.revision, self.always_push = args.hub_strategy, args.hub_revision, args.hub_always_push
        self.uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="covey-hub-push")
        self.pending: list[tuple[Future, Path]] = []  # the pushes not finished, with their hard-linked copies
        self.failures: list[str] = []  # pushes of checkpoints that failed, not yet reported (the push thread adds)

    @classmethod
    def connect(cls, args: GRPOConfig, run_dir: Path, world: World) -> HubPush | None:
        """Under push_to_hub, the pushes of the run, in the first process (which pushes; None in the
        others): the checks that the run can push, and its repo opened or created. A HubError, in
        every process, says what to do where it cannot."""
        if not args.push_to_hub:
            return None
        connected: list[HubPush] = []
        world.on_main(lambda: connected.append(cls._connect(args, run_dir)))
        return connected[0] if connected else None

    @classmethod
    def _connect(cls, args: GRPOConfig, run_dir: Path) -> HubPush:
        if hub_offline():
            raise HubError("push_to_hub needs the Hugging Face Hub, and HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is "
                           "set: unset it to push, or set push_to_hub: false (the run folder keeps the model)")
        from huggingface_hub import HfApi, get_token

        token = args.hub_token or get_token()
        if not token:
            raise HubError("push_to_hub needs a Hugging Face token that may write, and none is set: run "
                           "`hf auth login`, set HF_TOKEN, or give hub_token")
        if args.hub_model_id is None and args.output_dir is None:
            raise HubError("push_to_hub without hub_model_id names the repo after output_dir (as TRL), and this run "
                           "has none: give hub_model_id ('name' or 'org/name') or output_dir")
        name = args.hub_model_id or Path(args.output_dir).absolute().name
        api = HfApi()
        try:
            who = api.whoami(token=token)
        except Exception as e:
            status = getattr(getattr(e, "response", None), "status_code", None)
            if status == 401:
                raise HubError(f"the Hugging Face Hub refused the token ({e}); log in again with `hf auth login`, or "
                               "give a valid hub_token / HF_TOKEN") from None
            raise HubError(f"push_to_hub could not reach the Hugging Face Hub at {api.endpoint} ({type(e).__name__}: "
                           f"{e}); check the network connection (behind a proxy: HTTPS_PROXY), or set push_to_hub: "
                           "false") from None
        if ((who.get("auth") or {}).get("accessToken") or {}).get("role") == "read":
            raise HubError("the Hugging Face token is read-only, and push_to_hub writes: give a token with write "
                           "access (https://huggingface.co/settings/tokens)")
        try:
            repo = api.create_repo(name, token=token, private=args.hub_private_repo, exist_ok=True)
            if args.hub_revision:
                api.create_branch(repo.repo_id, branch=args.hub_revision, token=token, exist_ok=True)
        except Exception as e:
            raise HubError(f"push_to_hub could not open or create the repo {name!r}"
                           f"{f' (branch {args.hub_revision!r})' if args.hub_revision else ''} on the Hub "
                           f"({type(e).__name__}: {e}); check hub_model_id, and that the token may write to its "
                           "namespace") from None
        return cls(api, repo.repo_id, str(repo), args, token, run_dir)

    def push_checkpoint(self, checkpoint: Path, commit_message: str) -> list[str]:
        """Start pushing ``checkpoint`` as hub_strategy says (nothing under ``end``); what to tell the
        user: that it is on its way or skipped, and the pushes that failed since the last call."""
        said = self._failures()
        self.pending = [(future, staged) for future, staged in self.pending if not future.done()]
        if self.strategy == "end":
            return said
        if self.pending and not self.always_push:
            return [*said, f"{checkpoint.name} is not pushed to the Hub: the previous push is still uploading "
                           "(hub_always_push: true queues every checkpoint)"]
        staged = _linked_copy(checkpoint, Path(tempfile.mkdtemp(prefix=f"{STAGING}{checkpoint.name}-", dir=self.run_dir)))
        uploads = [(staged / "model", None, commit_message)]
        if self.strategy != "every_save":
            where = "last-checkpoint" if self.strategy == "checkpoint" else checkpoint.name
            uploads.append((staged, where, f"{commit_message}, checkpoint"))
        self.pending.append((self.uploader.submit(self._upload, checkpoint.name, uploads, staged), staged))
        return [*said, f"pushing {checkpoint.name} to {self.url}"]

    def _upload(self, name: str, uploads: list[tuple[Path, str | None, str]], staged: Path) -> None:
        """The uploads of one checkpoint (in the push thread): a failure is kept to be reported."""
        try:
            for folder, path_in_repo, message in uploads:
                self.api.upload_folder(repo_id=self.repo_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                       commit_message=message, token=self.token, revision=self.revision)
        except Exception as e:  # training goes on; the final model is pushed at the end whatever happened here
            self.failures.append(f"pushing {name} to {self.url} failed ({type(e).__name__}: {e})")
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def push_final(self, final_model: Path) -> list[str]:
        """Wait for the checkpoints' pushes, then upload ``final_model`` (the end of training); what to
        tell the user. A failure is a HubError that says how to push the saved model by hand."""
        wait([future for future, _ in self.pending])
        self.uploader.shutdown()
        said = self._failures()
        try:
            self.api.upload_folder(repo_id=self.repo_id, folder_path=str(final_model), commit_message="End of training",
                                   token=self.token, revision=self.revision)
        except Exception as e:
            branch = f" --revision {self.revision}" if self.revision else ""
            raise HubError(f"pushing the final model to {self.url} failed ({type(e).__name__}: {e}); it is saved in "
                           f"{final_model}: push it with `hf upload {self.repo_id} {final_model}{branch}`") from e
        return [*said, f"final model pushed to {self.url}"]

    def __enter__(self) -> HubPush:
        return self

    def __exit__(self, exc_type: type | None, *_: Any) -> None:
        if exc_type is not None:
            self.abandon()

    def abandon(self) -> None:
        """Training failed: drop the pushes not started (the one uploading finishes)."""
        for future, staged in self.pending:
            if future.cancel():
                shutil.rmtree(staged, ignore_errors=True)
        self.uploader.shutdown(wait=False)

    def _failures(self) -> list[str]:
        """The failed pushes not reported yet, as warnings."""
        said = []
        while self.failures:  # one pop at a time: the push thread may add meanwhile
            said.append(f"[yellow]{self.failures.pop(0)}[/]")
        return said


def _linked_copy(source: Path, into: Path) -> Path:
    """``into`` holding ``source``'s files as hard links (copies where the file system has none)."""
    for path in sorted(source.rglob("*")):
        target = into / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
    return into
