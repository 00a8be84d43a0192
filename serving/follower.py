"""Processes 1..N-1 of a multi-host run: receive process 0's messages (serving/multihost.py) and make the
same jitted calls on this process's own ModelRunner until process 0 says "shutdown"."""
from __future__ import annotations

import logging
import os

import jax

from serving import multihost, multihost_watch
from serving.runner import ModelRunner

log = logging.getLogger(__name__)


def follow(model) -> int:
    """Run process 0's jitted calls on this process until it says "shutdown". Returns an exit status.

    model: this process's Model, loaded with the same arguments (mesh included) as process 0's.
    On a lost coordinator (the collective fails) logs it and returns 1. Reports each finished
    message to the fault watch (multihost_watch), and a failure before returning non-zero.
    """
    me, watch = jax.process_index(), multihost_watch.current()
    chan, runner, steps = multihost.Channel(), None, 0
    log.info("process %d/%d: following process 0", me, jax.process_count())
    while True:
        try:
            control, tree = chan.receive()
            if watch:
                watch.fault_point()
            if control == "shutdown":
                log.info("process %d: shutdown from process 0 after %d steps", me, steps)
                if watch:
                    watch.stop()
                return 0
            if control == "init":
                if tree["config"] != model.config:
                    log.error("process %d: process 0 serves a different model config than this process loaded; "
                              "start every process with the same --model/--dtype/--mesh", me)
                    if watch:
                        watch.report_failed(ValueError("process 0 serves a different model config"))
                    return 2
                runner = ModelRunner(model.config, model.params, mesh=model.mesh, backend=model.backend,
                                     **tree["kwargs"])
            elif runner is None:
                raise RuntimeError(f"multi-host: {control!r} before the runner was set up")
            else:
                jax.block_until_ready((runner._call(control, *tree), runner.pools))   # finished, not queued
                steps += control == "step"
            if watch:
                watch.seq = chan.seq
        except Exception as e:  # noqa: BLE001 - report and leave; never hang on a dead coordinator
            log.error("process %d: lost process 0 (coordinator), or the call failed, after %d steps: %s",
                      me, steps, e)
            if watch:
                watch.report_failed(e)
            return 1


def exit_follower(status: int):
    """End a follower process: on failure skip jax.distributed's shutdown barrier (process 0 is gone)."""
    if status == 0:
        return status
    logging.shutdown()
    os._exit(status)
