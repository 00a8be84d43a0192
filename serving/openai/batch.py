"""Offline batch files in OpenAI's format, run on the engine, resumable exactly.

Input: JSONL, one request a line: {"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...the endpoint's request...}}. Output: one line per input line, in input
order: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}. A request the
endpoint refuses gets its status and error body (as the server would answer); a line that is no
request at all (bad JSON, missing fields, unknown url) gets `response: null` and an `error`.

Lines are read through a grain pipeline over the file's line offsets (memory: 8 bytes a line) in
windows; a window's requests run together on the engine (continuous batching), then their result
lines are appended to the output, flushed to disk, and the grain iterator's state is written next to
it with the output's length (`OUTPUT.state.json`, replaced atomically). A rerun after a crash or
Ctrl-C truncates the output to that length and continues from that state: no line lost, none twice.
Results are the same bytes whether or not the job was interrupted: ids come from line numbers,
`created` is the job's start time (kept in the state), every window starts with an empty prefix
cache, and a request without a `seed` is sampled with its line number as seed.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import grain
import numpy as np
from pydantic import ValidationError

from serving.openai import chat, completions
from serving.openai.app import check_generation_request, validation_error
from serving.openai.errors import APIError, bad_request
from serving.openai.generation import ServerState, engine_error
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from serving.scheduler import QueueFullError

ENDPOINTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
STATE_VERSION = 1


class JsonlLines(grain.sources.RandomAccessDataSource):
    """Line i of a file as (i, bytes), by seeking to its recorded offset (blank lines included, so
    line numbers are the file's)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        starts = [0]
        with open(self.path, "rb") as f:
            for line in f:
                starts.append(starts[-1] + len(line))
        self.size = starts.pop()
        self.offsets = np.asarray(starts + [self.size], np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int):
        i = int(i)
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[i]))
            return i, f.read(int(self.offsets[i + 1] - self.offsets[i]))


class LineError(Exception):
    """A line that is no request: answered with `response: null` and this error."""

    def __init__(self, code: str, message: str, custom_id=None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


def parse_line(raw: bytes):
    """(custom_id, url, body dict) of one input line; LineError when it is no batch request."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LineError("invalid_json", f"the line is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_request", "the line must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError("missing_custom_id", "custom_id: a non-empty string is required",
                        cid if isinstance(cid, (str, int, float)) else None)
    if obj.get("method", "POST") != "POST":
        raise LineError("invalid_method", f"method: only POST is supported, got {obj.get('method')!r}", cid)
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError("invalid_url", f"url: expected one of {sorted(ENDPOINTS)}, got {url!r}", cid)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "body: a JSON object is required", cid)
    return cid, url, body


class _Pending:
    """One admitted request: its engine request ids and how to build its response body."""

    def __init__(self, index: int, cid: str, url: str, req, plan, params, prompts, matcher_factory=None, images=()):
        self.index, self.cid, self.url, self.req = index, cid, url, req
        self.plan, self.params, self.prompts = plan, params, prompts
        self.matcher_factory, self.images = matcher_factory, images
        self.rids = [[f"{index}-{p}-{i}" for i in range(params.n)] for p in range(len(prompts))]


class BatchRunner:
    """Runs windows of lines on a synchronous LLMEngine with the server's own request handling."""

    def __init__(self, state: ServerState, engine, created: int):
        self.state, self.engine, self.created = state, engine, created

    def _prepare(self, index: int, raw: bytes) -> _Pending:
        cid, url, body = parse_line(raw)
        if body.get("seed") is None:     # sampled requests reproduce on a rerun
            body = {**body, "seed": index}
        try:
            try:
                req = ENDPOINTS[url].model_validate(body)
            except ValidationError as e:
                raise validation_error([{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors()])
            check_generation_request(self.state, req)
            if req.stream:
                raise bad_request("stream: not supported in batch files", param="stream")
            if url == "/v1/chat/completions":
                plan = chat.Plan(self.state, req)
                return _Pending(index, cid, url, req, plan, plan.params, [plan.prompt], plan.matcher_factory,
                                plan.images)
            params, prompts, matcher_factory = completions.prepare(self.state, req)
            return _Pending(index, cid, url, req, None, params, prompts, matcher_factory)
        except APIError as e:
            e.custom_id = cid
            raise

    def _admit(self, p: _Pending) -> None:
        """Queue every choice of `p` on the engine, or none (APIError)."""
        added = []
        try:
            for ids, rids in zip(p.prompts, p.rids):
                for i, rid in enumerate(rids):
                    self.engine.add_request(ids, p.params.for_child(i), request_id=rid, priority=p.req.priority,
                                            matcher=p.matcher_factory() if p.matcher_factory else None,
                                            images=p.images)
                    added.append(rid)
        except (ValueError, QueueFullError) as e:
            for rid in added:
                self.engine.abort(rid)
            err = engine_error(e)
            err.custom_id = p.cid
            raise err from None

    def _body(self, p: _Pending, finals: dict) -> dict:
        rid = f"{'chatcmpl' if p.plan is not None else 'cmpl'}-batch-{p.index}"
        per_prompt = [{i: finals[r] for i, r in enumerate(rids)} for rids in p.rids]
        if p.plan is not None:
            return chat.chat_body(self.state, p.plan, per_prompt[0], rid, self.created)
        return completions.completion_body(self.state, p.req, p.params, list(zip(p.prompts, per_prompt)), rid,
                                           self.created)

    def _generate(self, owner: dict, pending: list, on_done, refused: int) -> dict:
        """Step the engine until every admitted choice finished: {engine request id: RequestOutput}."""
        if on_done is not None:
            on_done(refused)
        finals = {}
        left = {p.index: sum(len(r) for r in p.rids) for p in pending}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    left[owner[out.request_id]] -= 1
                    if on_done is not None and left[owner[out.request_id]] == 0:
                        on_done(1)
        return finals

    def run_window(self, records, on_done=None) -> list[str]:
        """Result lines (each ending in a newline) of records [(line index, raw bytes)], in order."""
        cache = getattr(self.engine.scheduler, "cache", None)
        if cache is not None:        # the same start for every window, resumed or not
            cache.clear()
        results: dict[int, dict] = {}
        pending = []
        for index, raw in records:
            if not raw.strip():
                results[index] = _line(index, None, error=("empty_line", "the line is empty"))
                continue
            try:
                p = self._prepare(index, raw)
                self._admit(p)
                pending.append(p)
            except LineError as e:
                results[index] = _line(index, e.custom_id, error=(e.code, e.message))
            except APIError as e:
                results[index] = _line(index, getattr(e, "custom_id", None), status=e.status, body=e.body())
        owner = {rid: p.index for p in pending for rids in p.rids for rid in rids}
        try:
            finals = self._generate(owner, pending, on_done, len(results))
        except BaseException:       # Ctrl-C or a crash: leave the engine empty for whoever goes on
            for rid in owner:
                self.engine.abort(rid)
            raise
        for p in pending:
            results[p.index] = _line(p.index, p.cid, status=200, body=self._body(p, finals))
        return [json.dumps(results[i], ensure_ascii=False) + "\n" for i in sorted(results)]


def runner_for(model, model_name: str, engine_args, max_n: int = 128) -> BatchRunner:
    """A BatchRunner over a new LLMEngine for a loaded k3jax Model (images: data URLs only)."""
    from serving.engine import LLMEngine
    if model.tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer")
    engine = LLMEngine(model, engine_args)
    vision = None
    if model.vision is not None and engine_args.vision:
        from serving.image_inputs import ImageLoader, ImagePolicy
        vision = ImageLoader(model.vision, ImagePolicy(allow_local=False))
    state = ServerState(engine=None, tokenizer=model.tokenizer, model_name=model_name,
                        max_model_len=engine.max_model_len, metrics=None,
                        thinks_by_default=model.config.thinks_by_default, vision=vision, max_n=max_n)
    return BatchRunner(state, engine, created=0)


def _line(index: int, cid, *, status: Optional[int] = None, body=None, error=None) -> dict:
    response = None if status is None else {"status_code": status, "request_id": f"batch-{index}", "body": body}
    err = None if error is None else {"code": error[0], "message": error[1], "line": index + 1}
    return {"id": f"batch_req_{index}", "custom_id": cid, "response": response, "error": err}


class BatchJob:
    """Input file -> output file, resumable. The state file sits beside the output."""

    def __init__(self, input_path, output_path, *, window: int = 64, overwrite: bool = False,
                 created: Optional[int] = None):
        """created: the responses' `created` time for a new job (default: now); a resumed job keeps its own."""
        self.input, self.output = Path(input_path), Path(output_path)
        self.state_path = Path(f"{self.output}.state.json")
        self.window = window
        self.lines = JsonlLines(self.input)
        self.iterator = grain.MapDataset.source(self.lines).to_iter_dataset().__iter__()
        self.done, self.output_bytes, self.complete = 0, 0, False
        self.created = int(time.time()) if created is None else created
        if self.state_path.exists() and not overwrite:
            self._resume()
        elif self.output.exists() and not overwrite:
            raise ValueError(f"{self.output} exists and has no {self.state_path.name} to resume from: "
                             "pass --overwrite to start again")
        else:
            self.output.write_bytes(b"")
            self._save_state()

    def _resume(self) -> None:
        s = json.loads(self.state_path.read_text())
        if s.get("version") != STATE_VERSION or s.get("input_bytes") != self.lines.size:
            raise ValueError(f"{self.state_path} belongs to another input (or version): pass --overwrite to start again")
        if not self.output.exists() or self.output.stat().st_size < s["output_bytes"]:
            raise ValueError(f"{self.output} is shorter than {self.state_path} records: pass --overwrite")
        with open(self.output, "r+b") as f:    # drop what a killed window had begun to write
            f.truncate(s["output_bytes"])
        self.iterator.set_state(s["iterator"])
        self.done, self.output_bytes, self.created = s["done_lines"], s["output_bytes"], s["created"]
        self.complete = s.get("complete", False)

    def _save_state(self) -> None:
        s = {"version": STATE_VERSION, "input": str(self.input.resolve()), "input_bytes": self.lines.size,
             "lines": len(self.lines), "done_lines": self.done, "output_bytes": self.output_bytes,
             "created": self.created, "complete": self.complete, "iterator": self.iterator.get_state()}
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps(s))
        os.replace(tmp, self.state_path)

    def windows(self) -> Iterator[list]:
        while True:
            records = []
            for rec in self.iterator:
                records.append(rec)
                if len(records) == self.window:
                    break
            if not records:
                return
            yield records

    def run(self, runner: BatchRunner, progress=None) -> None:
        runner.created = self.created
        for records in self.windows():
            lines = runner.run_window(records, on_done=progress)
            data = "".join(lines).encode()
            with open(self.output, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self.done += len(records)
            self.output_bytes += len(data)
            self._save_state()
        self.complete = True
        self._save_state()
