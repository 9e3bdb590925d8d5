"""Gives what each turn of the executor did, and each engine it started, to the progress and to
the current stage's log in the run's report: an observer like the calibration and the estimates."""

from __future__ import annotations

from batchllm.engines.protocol import EngineConfig, WorkerReady
from batchllm.runtime.observer import RunObserver
from batchllm.runtime.progress import RunProgress
from batchllm.runtime.run_report import StageLog, engine_label
from batchllm.runtime.step_result import StepResult


class StageRecorder(RunObserver):
    def __init__(self, progress: RunProgress):
        self.progress = progress
        self.log: StageLog | None = None  # the current stage's (set when a stage begins)

    def engine_started(self, node: str, config: EngineConfig, load_time_s: float, ready: WorkerReady) -> None:
        assert self.log is not None, "an engine started outside a stage"
        self.log.add_start(node, engine_label(config), load_time_s)
        self.progress.stats[node].engine_load_s += load_time_s

    def observe(self, result: StepResult) -> None:
        assert self.log is not None, "a turn outside a stage"
        for commit in result.commits:
            self.progress.advance(commit.node, prompt_tokens=commit.prompt_tokens, output_tokens=commit.output_tokens,
                                  failed=commit.failed)
            self.log.add_tokens(commit.node, commit.prompt_tokens, commit.output_tokens)
        for engine_step in result.engine_steps:
            self.log.add_step(engine_label(engine_step.config), engine_step.step.wall_s)
            if engine_step.node is not None:
                self.progress.count_steps(engine_step.node, [engine_step.step])
