"""A draft model on the ring's head: a small model of the same tokenizer that proposes a
speculative pass's drafts (issue 24 item 1; `kafila-ctl host --draft-model M`).

The model is mlx-lm's own class for its architecture (`mlx_lm.utils.load_model`), run whole on the
head with its own cache per request. Drafts are proposed greedily (the draft model's argmax), so
each draft is a function of the history: the head's acceptance rules for point-mass drafts
(kafilad/proto/speculation.py `accept_greedy`, `accept_point_drafts`) stay exact, and the output
distribution is the target model's whatever the draft model proposes.

Each request's cache holds the tokens it was last fed; a new proposal keeps the longest prefix that
the history still shares (rejected drafts are cut with mlx-lm's `trim_prompt_cache`) and feeds the
rest, so a request's drafting costs about one draft-model step per draft.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from kafilad.errors import StageBuildError

#: tokens fed to the draft model per call when it catches up with a long history
PREFILL_CHUNK = 512
#: the error code of a draft model the head cannot use (kafilad/errors.py style: a short stable word)
DRAFT_MODEL_UNUSABLE = "draft_model_unusable"


def draft_model_bytes(model_dir: str | Path) -> int:
    """The bytes of a draft model's weights (its *.safetensors files), which the head must hold
    beside its stage: the planner counts them against the host's memory."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


class DraftModel:
    """A whole small model that proposes drafts greedily for each request (module docstring).

    Attributes:
        name: the model directory's name (status).
        nbytes: bytes of its parameters.
    """

    def __init__(self, model, name: str):
        self.model = model
        self.name = name
        self.nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        self._caches: dict[str, list] = {}
        self._fed: dict[str, list[int]] = {}

    @classmethod
    def load(cls, model_dir: str | Path, tokenizer=None) -> "DraftModel":
        """Load the draft model in `model_dir` (an mlx-lm model directory).

        Args:
            tokenizer: the target model's serving tokenizer (kafilad/executor/tokenizer.py), whose
                vocabulary the draft model's must equal; None skips that check.
        Raises:
            StageBuildError: code DRAFT_MODEL_UNUSABLE: the directory holds no model mlx-lm loads,
                its tokenizer differs from the target's, or its caches cannot be trimmed.
        """
        from mlx_lm.utils import load_model

        path = Path(model_dir)
        try:
            model, _config = load_model(path)
        except Exception as e:  # noqa: BLE001 - any loader failure is this one refusal
            raise StageBuildError(f"The draft model {path} could not be loaded: {e}", code=DRAFT_MODEL_UNUSABLE) from e
        if tokenizer is not None:
            from kafilad.executor.tokenizer import load_tokenizer
            try:
                theirs = load_tokenizer(path)
            except Exception as e:  # noqa: BLE001
                raise StageBuildError(f"The draft model {path} has no tokenizer to compare with the model's: {e}",
                                      code=DRAFT_MODEL_UNUSABLE) from e
            if theirs.get_vocab() != tokenizer.get_vocab():
                raise StageBuildError(f"The draft model {path} does not share the model's tokenizer (its vocabulary "
                                      f"differs); a draft model must use the same tokenizer.", code=DRAFT_MODEL_UNUSABLE)
        if not can_trim_prompt_cache(make_prompt_cache(model)):
            raise StageBuildError(f"The draft model {path} keeps caches that cannot be cut back (sliding windows, "
                                  "linear attention or SSM state), so its rejected drafts could not be undone.",
                                  code=DRAFT_MODEL_UNUSABLE)
        mx.eval(model.parameters())
        return cls(model, path.name)

    def propose(self, request_id: str, history: Sequence[int], k: int) -> list[int]:
        """Up to `k` greedy drafts after `history` (the request's prompt and output, the token being
        sent last). Runs on the MLX thread.

        Returns:
            k token ids ([] when k <= 0 or the history is empty).
        """
        if k <= 0 or not history:
            return []
        history = [int(t) for t in history]
        cache = self._caches.get(request_id)
        fed = self._fed.get(request_id, [])
        if cache is None:
            cache, fed = make_prompt_cache(self.model), []
            self._caches[request_id] = cache
        common = 0
        limit = min(len(fed), len(history) - 1)  # the last token is always fed: its logits give draft 1
        while common < limit and fed[common] == history[common]:
            common += 1
        if len(fed) > common:
            trim_prompt_cache(cache, len(fed) - common)
        todo = history[common:]
        for i in range(0, len(todo), PREFILL_CHUNK):
            logits = self.model(mx.array([todo[i:i + PREFILL_CHUNK]]), cache=cache)
        out: list[int] = []
        tok = int(mx.argmax(logits[0, -1]).item())
        for i in range(k):
            out.append(tok)
            if i == k - 1:
                break
            logits = self.model(mx.array([[tok]]), cache=cache)
            tok = int(mx.argmax(logits[0, -1]).item())
        self._fed[request_id] = history + out[:-1]  # the last draft was never fed
        return out

    def forget(self, request_id: str) -> None:
        """The request ended: its cache goes."""
        self._caches.pop(request_id, None)
        self._fed.pop(request_id, None)

    def forget_all(self) -> None:
        """The ring broke: every request's cache goes."""
        self._caches.clear()
        self._fed.clear()

    def held_tokens(self, request_id: str) -> Optional[int]:
        """Tokens the request's cache holds (tests), or None without one."""
        fed = self._fed.get(request_id)
        return None if fed is None else len(fed)
