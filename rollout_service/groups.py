"""One prompt's group, from its index to the record the rollout loop pushes: generated on the
engine (plain samples, answers written with ``task.tool``, or ``task.environment``'s episodes),
scored by the task, and written as a GroupRecord.

This is the loop's one job that is about a single group and not about the fleet: what a prompt
becomes. The loop (rollout_service/loop.py) decides when a group starts, leases its prompt and
pushes or gives back what comes out of here; it was one 349-line class doing both, so the
making of a group lives here on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np

from rlpipe.config import ConfigError, RunConfig
from rlpipe.schema import GroupRecord, Sample
from rollout_service.engine import RolloutEngine
from rollout_service.episodes import EpisodeRunner
from rollout_service.inline_tools import answer_with_tool, load_tool
from rollout_service.metrics import RolloutMetrics
from rollout_service.tasks import PromptEncoder, Task

log = logging.getLogger(__name__)

TOOL_SEED_STRIDE = 7919  # the seeds of a group's answers with a tool: apart by more than their pauses


def group_seed(run_seed: int, index: int) -> int:
    """The sampling seed of the group for prompt ``index``: reproducible on any worker."""
    return (run_seed * 1_000_003 + index) % (2**31)


@dataclass
class Group:
    """One prompt's group in flight. Until it reaches ``pushing`` it can still be given back."""

    index: int
    attempt: int = 0
    phase: str = "generating"  # generating -> scoring -> pushing, or -> failed (given back by the group itself)


class GroupGenerator:
    """Makes a prompt's group: ``await generator(group)`` is its record, or None for a prompt
    too long to sample (skipped). It sets ``group.phase`` to ``scoring`` once the engine is done."""

    def __init__(self, cfg: RunConfig, worker_id: str, engine: RolloutEngine, task: Task, tokenizer,
                 metrics: RolloutMetrics):
        self.cfg, self.worker_id, self.engine, self.task = cfg, worker_id, engine, task
        self.tokenizer, self.metrics = tokenizer, metrics
        self.encode = PromptEncoder(cfg.task, tokenizer, cfg.model.path or "the model")  # text -> the engine's ids
        # task.environment: each sample is a multi-turn episode (rollout_service/episodes.py)
        self.episodes = EpisodeRunner(cfg, tokenizer, engine, metrics) if cfg.task.environment else None
        # task.tool: each answer is written with an in-turn tool (rollout_service/inline_tools.py)
        self.tool = load_tool(cfg.task.tool) if cfg.task.tool else None
        k = cfg.learner.score_centering_k
        if k and k > len(tokenizer):  # vLLM's top-k of more ids than the vocabulary kills it
            raise ConfigError(f"learner.score_centering_k: {k} is more than the model's "
                              f"{len(tokenizer)} token ids")

    async def __call__(self, group: Group) -> GroupRecord | None:
        s = self.cfg.sampling
        prompt = self.task.prompt(group.index)
        if self.episodes is not None:
            return await self._episodes(group, prompt)
        prompt_ids = self.encode(prompt.text, prompt.messages)  # the record keeps these ids, as the engine got them
        if len(prompt_ids) + s.max_tokens > self.cfg.rollout.max_model_len:
            log.warning("skipping prompt %s: %d tokens + max_tokens %d exceed rollout.max_model_len %d",
                        prompt.prompt_id, len(prompt_ids), s.max_tokens, self.cfg.rollout.max_model_len)
            self.metrics.prompts_skipped.inc()
            return None
        seed = group_seed(self.cfg.seed, group.index)
        t0 = time.perf_counter()
        if self.tool is not None:
            return await self._with_tool(group, prompt, prompt_ids, seed, t0)
        results, v0, v1 = await self.engine.generate(
            prompt_ids, n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_tokens=s.max_tokens, seed=seed, with_topk=self.cfg.learner.score_centering_k > 0)
        gen_seconds = time.perf_counter() - t0
        group.phase = "scoring"
        # Rewards read the decoded text; the record keeps the token ids exactly as sampled.
        texts = [self.tokenizer.decode(res.tokens, skip_special_tokens=True) for res in results]
        scores = await self.task.score(prompt, texts)
        samples = [Sample(res.tokens, res.logprobs, res.finish_reason, reward, res.versions, info, routes=res.routes,
                          topk_ids=res.topk_ids, topk_logprobs=res.topk_logprobs)  # score centering's, when asked
                   for res, (reward, info) in zip(results, scores)]
        return self._record(group, prompt, prompt_ids, samples, v0, v1, seed, gen_seconds)

    async def _with_tool(self, group: Group, prompt, prompt_ids: list[int], seed: int, t0: float) -> GroupRecord:
        """``sampling.n`` answers written with ``task.tool`` (rollout_service/inline_tools.py), each its own
        request and seed, scored by the task on the whole message (the tool's values in it)."""
        s = self.cfg.sampling
        answers = await asyncio.gather(*(
            answer_with_tool(self.engine, self.tokenizer, prompt_ids, self.tool(), s.max_tokens,
                             (seed + TOOL_SEED_STRIDE * i) % 2**31, temperature=s.temperature, top_p=s.top_p,
                             top_k=s.top_k) for i in range(s.n)))
        gen_seconds = time.perf_counter() - t0
        group.phase = "scoring"
        v0, v1 = min(a.v0 for a in answers), max(a.v1 for a in answers)
        scores = await self.task.score(prompt, [self.tokenizer.decode(a.tokens, skip_special_tokens=True)
                                                for a in answers])
        samples = [Sample(a.tokens, a.logprobs, a.finish_reason, reward, a.versions if (a.versions != v0).any() else None,
                          {**(info or {}), "tool_calls": a.calls}, mask=a.mask)
                   for a, (reward, info) in zip(answers, scores)]
        return self._record(group, prompt, prompt_ids, samples, v0, v1, seed, gen_seconds)

    async def _episodes(self, group: Group, prompt) -> GroupRecord:
        """``sampling.n`` episodes of ``task.environment`` on the prompt, rewarded by it."""
        seed = group_seed(self.cfg.seed, group.index)
        t0 = time.perf_counter()
        prompt_ids, samples, v0, v1 = await self.episodes.group(prompt, self.cfg.sampling.n, seed)
        return self._record(group, prompt, prompt_ids, samples, v0, v1, seed, time.perf_counter() - t0)

    def _record(self, group: Group, prompt, prompt_ids, samples: list[Sample], v0: int, v1: int, seed: int,
                gen_seconds: float) -> GroupRecord:
        s = self.cfg.sampling
        return GroupRecord(
            run_id=self.cfg.run_id, group_id=uuid.uuid4().hex, prompt_id=prompt.prompt_id,
            worker_id=self.worker_id, policy_version=v0, policy_version_end=v1,
            precision=self.engine.profile.precision, quant_profile=self.engine.quant_profile,
            sampling={"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                      "max_tokens": s.max_tokens, "seed": seed},
            prompt_tokens=np.asarray(prompt_ids, dtype=np.int32), samples=samples, gen_seconds=gen_seconds,
            prompt_index=group.index, attempt=group.attempt,
            # routing replay: the engine's experts travel with the samples (an aborted one has none: the
            # reader refuses the group, as the learner could not replay it)
            routing=self.engine.routing if any(x.routes is not None for x in samples) else None,
            sampler_topk=self.cfg.learner.score_centering_k if samples[0].topk_ids is not None else 0,
        )
