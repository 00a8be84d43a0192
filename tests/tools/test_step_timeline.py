"""benchmarks/step_timeline.py: the host timer's exclusive accounting and restore, and a timed engine run whose
parts add up to its steps."""
import time

from benchmarks.step_timeline import HostTimer, report, run_timed


class _Runner:
    def launch(self, n):
        time.sleep(0.002)
        return self.fetch(n)            # a timed call inside another: counted once, in the inner part

    @staticmethod
    def fetch(n):
        time.sleep(0.005)
        return n


class _Engine:
    spec = None

    def __init__(self):
        self.runner = _Runner()


def test_host_timer_counts_nested_calls_once_and_restores_the_methods():
    eng = _Engine()
    with HostTimer(eng) as timer:
        assert eng.runner.launch(3) == 3
    assert 0.005 <= timer.total["fetch"] < 0.05
    assert 0.002 <= timer.total["launch"] < timer.total["fetch"]     # launch's own time excludes its fetch
    assert "fetch" not in eng.runner.__dict__ and "launch" not in eng.runner.__dict__
    assert eng.runner.launch.__func__ is _Runner.launch


def test_run_timed_on_the_tiny_engine(tmp_path):
    from k3jax import load_model
    from serving.engine import LLMEngine
    from serving.engine_args import EngineArgs

    model = load_model("tiny-random", dtype="float32")
    args = EngineArgs(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, page_size=16, num_pages=16,
                      num_slots=8, token_buckets=(64,), seq_buckets=(4,), warmup=False, vision=False,
                      compilation_cache_dir=str(tmp_path))
    engine = LLMEngine(model, args)
    walls, parts, traced, tokens = run_timed(engine, [list(range(3, 40))], 10)
    assert traced == 0 and not engine.has_unfinished()
    assert len(walls) >= 8 and tokens == len(walls)            # one token a decode step, none lost
    assert parts["fetch"] > 0 and parts["launch"] > 0 and parts["inputs"] > 0 and sum(parts.values()) <= sum(walls)
    assert "launch" not in engine.runner.__dict__              # the engine's own methods again
    text = report("off", walls, parts, tokens)
    assert f"{len(walls)} steps" in text and "fetch" in text


def test_busy_time_is_the_union_of_kernel_intervals():
    from benchmarks.profile_step import busy_time
    # (name, duration, stats, start): two overlapping kernels on two streams, then one after a 50 ns gap
    events = [("a", 100, {}, 0), ("b", 100, {}, 50), ("c", 10, {}, 200), ("d", 20, {}, 60)]
    busy, span, gaps = busy_time(events)
    assert (busy, span) == (160, 210)
    assert gaps == [(50, 1, 2)]
