"""Shared settings of the sharding tests and their subprocesses (the tiny model's greedy run)."""

# Three sequences of different lengths in one step: prefill of all three, then decodes.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [42, 42, 42, 42, 42]]
MAX_NEW = 6
# One 16-token bucket for prefill and decode: every run compiles the step once.
GEN = dict(page_size=16, bucket_tokens=16, pages_per_seq=2)
# 8 pages / 8 slots split evenly over data*expert (<= 8); page/slot 0 stays the sink.
POOL = dict(num_pages=8, page_size=16, num_slots=8)


def run_all(cmds, env, timeout: float = 200, before_wait=None) -> list:
    """Start one subprocess per command, run before_wait() meanwhile, wait for all, assert each
    exited 0 (showing its log otherwise) and return the logs; stragglers are killed."""
    import subprocess
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    try:
        extra = before_wait() if before_wait else None
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return logs if before_wait is None else (logs, extra)
