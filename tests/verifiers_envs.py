"""Environments written for `verifiers` 0.4 (`verifiers.v1`), built locally for the adapter's tests
(no hub): a single-turn question-answer taskset and a tool taskset with an `add` tool. Each
rubric also has a dense reward (the share of digits in the reply) so a random tiny model's
samples differ in reward and the rubric's signal reaches the loss."""

from __future__ import annotations

import verifiers.v1 as vf


def digit_share(text: str) -> float:
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


class QAData(vf.TaskData):
    answer: str


class QATask(vf.Task[QAData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        return digit_share(trace.last_reply)


class QAConfig(vf.TasksetConfig):
    pass


class QATaskset(vf.Taskset[QATask, QAConfig]):
    def load(self):
        for a in range(12):
            yield QATask(QAData(prompt=f"What is {a}+{a}?", system_prompt="Answer briefly.", answer=str(2 * a)), self.config.task)


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"  # the model sees calc_add

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcData(vf.TaskData):
    answer: int


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.answer) in trace.last_reply)

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        return digit_share(trace.last_reply)

    @vf.metric
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.name == "calc_add" for m in trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        for a in range(10, 22):
            yield CalcTask(CalcData(prompt=f"Use the tool to compute {a}+{a + 3}.", answer=2 * a + 3), self.config.task)


def qa_taskset() -> QATaskset:
    return QATaskset(QAConfig())


def calc_taskset() -> CalcTaskset:
    return CalcTaskset(CalcConfig())
