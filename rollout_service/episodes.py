"""Multi-turn episodes in the rollout loop: each of a prompt's ``n`` samples is an episode
of an environment (rollout_service/environments.py), driven through a token-exact session
(rollout_service/sessions.py) exactly as an agent drives one over HTTP, and the group is
pushed like a single-turn one, each sample with its loss mask (rlpipe/schema.py).

The loop has a session store of its own: its episodes are bounded by the same limits
(``rollout.session_max_turns``, ``session_max_tokens``) but neither count against the
API's ``max_sessions`` nor take the API's share of the engine. An episode that hits a
limit ends there with reward 0 (``reward_info.truncated`` names the key), as an answer
never given. Environment steps run in threads of their own, each within
``task.environment_timeout_s``, and a step past it is abandoned, not waited on
(rollout_service.tasks.Abandoning); an environment that raises, times out or returns a
reward or info the record cannot take (rollout_service.tasks.checked_score) fails the group,
whose prompt goes back like one whose reward failed (RewardError).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from fastapi import HTTPException

from rlpipe.schema import Sample
from rollout_service.api_models import Finish, Turn
from rollout_service.environments import load_environment
from rollout_service.sessions import Sessions, load_chat_template
from rollout_service.tasks import Abandoning, RewardError, checked_score

STEPS_AT_ONCE = 16  # environment steps running at once (an environment may wait on a sandbox or a service)


class EpisodeRunner:
    def __init__(self, cfg, tokenizer, engine, metrics):
        self.cfg, self.engine, self.metrics = cfg, engine, metrics
        self.make_env = load_environment(cfg.task.environment)
        self.where = f"task.environment {cfg.task.environment}"
        self.steps = Abandoning(self.where, cfg.task.environment_timeout_s, STEPS_AT_ONCE,
                                "task.environment_timeout_s")
        limits = cfg.rollout.model_copy(update={"max_sessions": 2**31 - 1})  # the loop's own are bounded by slots
        self.sessions = Sessions(limits, tokenizer, load_chat_template(cfg.rollout.chat_template, tokenizer),
                                 self._sample, lambda: engine.version, metrics)

    @property
    def stuck(self) -> str | None:
        """Why episodes cannot go on (their environment's steps are stuck), or None."""
        return self.steps.stuck

    async def _sample(self, ids: list[int], sampling: dict):
        results, v0, v1 = await self.engine.generate(ids, n=1, **sampling)
        return results[0], v0, v1

    async def group(self, prompt, n: int, seed: int) -> tuple[list[int], list[Sample], int, int]:
        """``n`` episodes on ``prompt``: ``(prompt ids, samples, oldest version, newest version)``."""
        episodes = await asyncio.gather(*(self.episode(prompt, (seed + i) % 2**31) for i in range(n)))
        prompt_ids = episodes[0][0].token_ids[:episodes[0][0].prompt_length]
        samples = []
        for ep, reward, info, routes in episodes:
            if ep.token_ids[:ep.prompt_length] != prompt_ids:  # the environment's reset is not deterministic
                raise RewardError(f"task.environment {self.cfg.task.environment}: episodes of one prompt opened "
                                  "on different messages; a group's samples share their prompt")
            p = ep.prompt_length
            versions = np.asarray(ep.versions[p:], dtype=np.int32)
            samples.append(Sample(np.asarray(ep.token_ids[p:], dtype=np.int32),
                                  np.asarray(ep.logprobs[p:], dtype=np.float32), ep.finish_reasons[-1], reward,
                                  versions if (versions != ep.policy_version).any() else None, info,
                                  mask=np.asarray(ep.mask[p:], dtype=np.uint8), routes=routes))
        return prompt_ids, samples, min(e[0].policy_version for e in episodes), \
            max(e[0].policy_version_end for e in episodes)

    async def episode(self, prompt, seed: int):
        """One episode: ``(Episode, reward, reward_info, routes)``; routes (routing replay, else
        None) one row per token but the last, prompt included (rollout_service/sessions.py)."""
        s = self.cfg.sampling
        env = self.make_env(prompt.answer)
        session = self.sessions.start(await self._step(env.reset, prompt), None, None, None)
        observation, reward, info = [], 0.0, {}
        try:
            while True:
                turn = Turn(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                            seed=seed)
                result = await self.sessions.turn(session, turn, observation, max_tokens_field=None)
                step = await self._step(env.step, result.text)
                reward, info = step.reward, step.info
                if step.done:
                    break
                observation = [step.observation]
        except HTTPException as e:  # a session limit: the episode ends unanswered
            limit = str(e.detail).split(":", 1)[0]
            reward, info = 0.0, {**(info if isinstance(info, dict) else {}), "truncated": limit}
        if isinstance(info, dict):
            info = {**info, "turns": len(session.finish_reasons)}
        reward, info = checked_score(reward, info, self.where)
        return self.sessions.finish(session, Finish(reward=reward)), reward, info, session.routes

    async def _step(self, fn, arg):
        t0 = time.perf_counter()
        try:
            return await self.steps(fn, arg)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"{self.where} raised {type(e).__name__}: {e}") from e
        finally:
            self.metrics.environment_seconds.observe(time.perf_counter() - t0)
