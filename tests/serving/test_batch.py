"""Offline batch files (serving/openai/batch.py, python -m k3jax.batch) on the seeded tiny model:
one result line per request in order, bad lines as error lines, and a job interrupted mid-way
(and with a half-written window on disk) resumes to the same bytes as an uninterrupted run."""
import json

import pytest

from serving.openai.batch import BatchJob, JsonlLines, runner_for

CREATED = 1_700_000_000     # both jobs' start time, so that their bytes can be compared


def _requests():
    chat = lambda i, **kw: {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
                            "body": {"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 3,
                                     "temperature": 0, **kw}}
    lines = [json.dumps(chat(0)), json.dumps(chat(3)),
             json.dumps({"custom_id": "cmp", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": ["ab", "cd"], "max_tokens": 2, "n": 2, "temperature": 0.8}}),
             "{not json",
             json.dumps({"custom_id": "neg", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}}),
             json.dumps({"custom_id": "far", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 10**6}}),
             json.dumps({"custom_id": "emb", "url": "/v1/embeddings", "body": {"input": "x"}}),
             "",
             json.dumps(chat(2, stream=True)),
             json.dumps(chat(1, temperature=1.0))]          # sampled, no seed given: in the resumed part
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from k3jax import load_model
    from serving.engine_args import EngineArgs
    args = EngineArgs(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, num_pages=64, num_slots=16,
                      token_buckets=(32,), seq_buckets=(4,), warmup=False, vision=False,
                      compilation_cache_dir=str(tmp_path_factory.getbasetemp() / "xla"))
    return runner_for(load_model("tiny-random", dtype="float32"), "tiny-random", args)


@pytest.fixture(scope="module")
def whole(runner, tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    (d / "req.jsonl").write_text(_requests())
    job = BatchJob(d / "req.jsonl", d / "out.jsonl", window=3, created=CREATED)
    job.run(runner)
    return d, (d / "out.jsonl").read_bytes()


def test_one_result_per_line_in_order(whole):
    d, out = whole
    rows = [json.loads(x) for x in out.decode().splitlines()]
    assert [r["id"] for r in rows] == [f"batch_req_{i}" for i in range(10)]
    assert [r["custom_id"] for r in rows] == ["chat-0", "chat-3", "cmp", None, "neg", "far", "emb", None, "chat-2",
                                             "chat-1"]
    ok = {r["custom_id"]: r["response"]["body"] for r in rows if r["response"] and r["response"]["status_code"] == 200}
    assert sorted(ok) == ["chat-0", "chat-1", "chat-3", "cmp"]
    assert ok["chat-0"]["object"] == "chat.completion" and ok["chat-0"]["usage"]["completion_tokens"] <= 3
    assert len(ok["cmp"]["choices"]) == 4 and [c["index"] for c in ok["cmp"]["choices"]] == [0, 1, 2, 3]
    status = {r["custom_id"]: r["response"]["status_code"] for r in rows if r["response"]}
    assert status["neg"] == status["far"] == status["chat-2"] == 400
    codes = [r["error"]["code"] for r in rows if r["error"]]
    assert codes == ["invalid_json", "invalid_url", "empty_line"]
    state = json.loads((d / "out.jsonl.state.json").read_text())
    assert state["complete"] and state["done_lines"] == 10 and state["output_bytes"] == len(out)


def test_interrupted_job_resumes_to_identical_bytes(runner, whole, tmp_path):
    _, expected = whole
    (tmp_path / "req.jsonl").write_text(_requests())
    job = BatchJob(tmp_path / "req.jsonl", tmp_path / "out.jsonl", window=3, created=CREATED)

    def crash(n):
        if job.done == 3:            # inside the second window: its results are not written
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        job.run(runner, progress=crash)
    assert job.done == 3
    with open(tmp_path / "out.jsonl", "ab") as f:   # a kill while a window was being appended
        f.write(b'{"id": "batch_req_3", "custom_id": nu')
    assert not runner.engine.has_unfinished()        # the interrupted window's requests were aborted
    resumed = BatchJob(tmp_path / "req.jsonl", tmp_path / "out.jsonl", window=3)   # created: from the state
    assert resumed.done == 3 and not resumed.complete
    resumed.run(runner)
    assert (tmp_path / "out.jsonl").read_bytes() == expected


def test_refuses_to_clobber_or_mix_inputs(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"custom_id": "x"}\n')
    (tmp_path / "out.jsonl").write_text("old results\n")
    with pytest.raises(ValueError, match="--overwrite"):
        BatchJob(tmp_path / "a.jsonl", tmp_path / "out.jsonl")
    BatchJob(tmp_path / "a.jsonl", tmp_path / "out.jsonl", overwrite=True)
    assert (tmp_path / "out.jsonl").read_bytes() == b""
    (tmp_path / "a.jsonl").write_text('{"custom_id": "x"}\n{"custom_id": "y"}\n')   # another input now
    with pytest.raises(ValueError, match="another input"):
        BatchJob(tmp_path / "a.jsonl", tmp_path / "out.jsonl")


def test_line_source_keeps_file_line_numbers(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_bytes(b'{"a": 1}\n\n{"b": 2}')          # blank line kept, no final newline
    src = JsonlLines(f)
    assert len(src) == 3 and [src[i] for i in range(3)] == [(0, b'{"a": 1}\n'), (1, b"\n"), (2, b'{"b": 2}')]
    f.write_bytes(b"")
    assert len(JsonlLines(f)) == 0
