"""The differential check's inputs as one schema: completions replies and recorded reference files.

Both the reference server's replies (``--ref-url``), the server under test's replies, and a
recording (``--ref-file``, written by ``--record-differential``) are parsed here, with pydantic,
into the engine check's request record (``prompt_len``, ``prompt_logprobs``, ``tokens``, ``top``);
then every run is held to the prompts it answers (one request per prompt, each prompt's length,
``max_tokens`` generated: greedy with ``ignore_eos`` stops at nothing else). Any shape error is a
:class:`ShapeError` naming the source and the field: for a reference it is a harness failure
(exit 2), never a comparison that blames the server under test.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from overlay.regress.errors import RegressError

FORMAT = 1


class ShapeError(RegressError):
    """A reply or recording that does not have the differential check's shape (harness, exit 2)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _token_id(key: str) -> int:
    """``token_id:123`` (``return_tokens_as_token_ids``) -> 123."""
    if not key.startswith("token_id:") or not key[len("token_id:"):].isdigit():
        raise ValueError(f"expected 'token_id:N' keys (return_tokens_as_token_ids), got {key!r}")
    return int(key[len("token_id:"):])


class _PromptLogprob(_Model):
    logprob: float


class _Logprobs(_Model):
    tokens: list[str] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[str] | None) -> list[str] | None:
        for key in v or []:
            _token_id(key)
        return v


class _Choice(_Model):
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None
    prompt_logprobs: list[dict[str, _PromptLogprob] | None] | None = None


class _Reply(_Model):
    choices: list[_Choice] = Field(min_length=1)


class Request(_Model):
    """One prompt's outputs: its logprobs position by position, the greedy tokens and their top-k."""

    prompt_len: int = Field(ge=1)
    prompt_logprobs: list[float | None]
    tokens: list[int]
    top: list[list[tuple[int, float]]]

    @model_validator(mode="after")
    def _lengths(self) -> Request:
        if len(self.prompt_logprobs) != self.prompt_len:
            raise ValueError(f"{len(self.prompt_logprobs)} prompt logprobs for a {self.prompt_len}-token prompt")
        if len(self.top) != len(self.tokens):
            raise ValueError(f"{len(self.top)} top-logprob rows for {len(self.tokens)} tokens")
        return self


class Run(_Model):
    requests: list[Request]
    model: str = ""
    url: str = ""


class Recording(_Model):
    """A ``--record-differential`` file: the reference's outputs (``runs[0]``) and its spread runs."""

    format: Literal[1]
    prompts_sha256: str
    runs: list[Run] = Field(min_length=1)
    model: str = ""


def _why(exc: ValidationError) -> str:
    """A pydantic error as one line: ``field.path: message`` for the first few."""
    parts = [f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors()[:3]]
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse_reply(body: Any, prompt: list[int], source: str) -> dict[str, Any]:
    """A completions reply (its first choice) as a request record; ``ShapeError`` naming ``source``."""
    try:
        choice = _Reply.model_validate(body).choices[0]
    except ValidationError as exc:
        raise ShapeError(f"{source}: not a completions reply: {_why(exc)}") from None
    lp = choice.logprobs or _Logprobs()
    try:
        tokens = choice.token_ids if choice.token_ids is not None else [_token_id(t) for t in lp.tokens or []]
        top = [sorted(((_token_id(k), v) for k, v in (row or {}).items()), key=lambda kv: (-kv[1], kv[0]))
               for row in lp.top_logprobs or []]
    except ValueError as exc:
        raise ShapeError(f"{source}: choices.0.logprobs: {exc}") from None
    if choice.prompt_logprobs is None:
        raise ShapeError(f"{source}: the reply has no prompt_logprobs (a vLLM extension of the completions API)")
    prompt_lp: list[float | None] = [None]
    for pos, row in enumerate(choice.prompt_logprobs[1:], start=1):
        entry = (row or {}).get(str(prompt[pos])) if pos < len(prompt) else None
        prompt_lp.append(entry.logprob if entry else None)
    record = {"prompt_len": len(prompt), "prompt_logprobs": prompt_lp, "tokens": tokens,
              "top": [[[t, v] for t, v in row] for row in top]}
    try:
        Request.model_validate(record)
    except ValidationError as exc:
        raise ShapeError(f"{source}: {_why(exc)} (prompt_logprobs has {len(choice.prompt_logprobs)} rows, "
                             f"top_logprobs {len(top)})") from None
    return record


def check_run(run: dict[str, Any], ids: list[list[int]], max_tokens: int, source: str) -> None:
    """``run`` answers ``ids``: one request per prompt, each as long, ``max_tokens`` tokens each."""
    requests = run["requests"]
    if len(requests) != len(ids):
        raise ShapeError(f"{source}: {len(requests)} requests for the profile's {len(ids)} prompts")
    for i, (req, prompt) in enumerate(zip(requests, ids, strict=True)):
        if req["prompt_len"] != len(prompt):
            raise ShapeError(f"{source}: requests[{i}]: a {req['prompt_len']}-token prompt where the "
                                 f"profile's has {len(prompt)}")
        if len(req["tokens"]) != max_tokens:
            raise ShapeError(f"{source}: requests[{i}]: {len(req['tokens'])} tokens generated for max_tokens "
                                 f"{max_tokens} (ignore_eos): the reference stopped early, not the server under test")


def load_recording(text: str, source: str, ids: list[list[int]], prompts_sha256: str,
                   max_tokens: int) -> list[dict[str, Any]]:
    """The runs of a recording (reference first), each checked against the prompts."""
    try:
        doc = Recording.model_validate_json(text)
    except ValidationError as exc:
        raise ShapeError(f"{source}: not a recording of format {FORMAT} (--record-differential): "
                             f"{_why(exc)}") from None
    if doc.prompts_sha256 != prompts_sha256:
        raise ShapeError(f"{source}: recorded for other prompts (the profile's differential section "
                             "changed since): record the reference again")
    runs = [r.model_dump(mode="json") for r in doc.runs]
    for k, run in enumerate(runs):
        check_run(run, ids, max_tokens, f"{source}: runs[{k}]")
    return runs
