"""bench_spec's forced-acceptance row: forced_tokens' values, and an engine whose verification programs are wrapped
by force_acceptance accepting wrong drafts (then the plain engine back after undo)."""
import numpy as np

from benchmarks.bench_spec import force_acceptance, forced_tokens


def test_forced_tokens_keep_every_draft_then_the_greedy_token_after_them():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 5, 11)).astype(np.float32)
    drafts = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 1]], np.int32)
    num_drafts = np.array([4, 2, 0], np.int32)
    toks, acc = forced_tokens(logits, drafts, num_drafts)
    greedy = logits.argmax(-1)
    np.testing.assert_array_equal(np.asarray(acc), num_drafts)
    np.testing.assert_array_equal(np.asarray(toks), [[1, 2, 3, 4, greedy[0, 4]],
                                                     [5, 6] + [greedy[1, 2]] * 3,
                                                     [greedy[2, 0]] * 5])


class Wrong:
    """Proposes K tokens no greedy model would agree with: the reference shifted by one."""

    def __init__(self, ref, vocab):
        self.ref, self.vocab = ref, vocab

    def propose(self, reqs, ks):
        return [[(t + 1) % self.vocab for t in self.ref[len(r.output_ids):len(r.output_ids) + k]]
                for r, k in zip(reqs, ks)]


def test_force_acceptance_accepts_wrong_drafts_and_undoes(tmp_path):
    from k3jax import load_model
    from serving.engine import LLMEngine
    from serving.engine_args import EngineArgs
    from serving.sampling_params import SamplingParams
    from serving.spec import make_speculator

    model = load_model("tiny-random", dtype="float32")
    args = EngineArgs(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, page_size=16, num_pages=16,
                      num_slots=40, token_buckets=(64,), seq_buckets=(4,), warmup=False, vision=False,
                      compilation_cache_dir=str(tmp_path), speculative="ngram", num_speculative_tokens=3,
                      speculative_adaptive=False)
    engine = LLMEngine(model, args)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(drafter):
        engine.spec = make_speculator(args, model, engine.max_model_len)
        engine.spec.drafter = drafter
        engine.add_request(prompt, params, request_id="r")
        done = [o for _ in range(100) if engine.has_unfinished() for o in engine.step() if o.finished]
        return done[0].outputs[0].token_ids, engine.spec.metrics()["spec_acceptance_rate"]

    ref, _ = run(Wrong([], model.config.vocab_size))             # proposes nothing: plain greedy decoding
    wrong = Wrong(ref, model.config.vocab_size)
    undo = force_acceptance(engine.runner)
    forced, rate = run(wrong)
    undo()
    assert rate == 1.0
    # the first verification feeds ref[0] and accepts 3 wrong drafts; the token after them is the model's own
    assert forced[:4] == [ref[0]] + [(t + 1) % model.config.vocab_size for t in ref[1:4]]
    assert forced != ref
    again, rate = run(wrong)
    assert rate == 0.0 and again == ref


def test_quick_rows_on_the_tiny_model(capsys):
    """bench_spec --quick on CPU: an engine without warm-up, c1 off then forced acceptance, every draft accepted
    and (fp32, reference ops) the same tokens as off."""
    from benchmarks.bench_spec import main
    main(["--model", "tiny-random", "--dtype", "float32", "--context", "64", "--c1-tokens", "16", "--cN", "0",
          "--quick"])
    table = capsys.readouterr().out.split("| run |")[-1]
    rows = [line for line in table.splitlines() if line.startswith("| c1")]
    assert [r.split(" | ")[0] for r in rows] == ["| c1 off", "| c1 K=4 forced acceptance"]
    assert "acceptance 1.00; same tokens" in rows[1]
