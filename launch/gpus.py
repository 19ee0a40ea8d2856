"""Which CUDA devices each role sees: the ``CUDA_VISIBLE_DEVICES`` that ``rlpipe demo`` and
``rlpipe up`` give the learner and each worker.

Without it every process sees every GPU and opens ``cuda:0``: on an 8-GPU node the learner
and every worker would land on GPU 0. ``learner.gpus`` names one device per learner rank
(torchrun's ranks then take ``cuda:LOCAL_RANK`` among them); ``rollout.gpus`` is shared out
in consecutive slices, one per worker, each as large as its engine
(``rollout.engine``'s tensor x pipeline parallel size, so 1 today). The two may overlap
(a learner beside a worker on one GPU, with ``rollout.engine.gpu_memory_utilization``
leaving it room); slices of workers never do.

Left empty on a machine with GPUs, both are planned here: the learner takes the first
``learner.ranks`` devices and the workers share out the rest. When there are too few for
that, the plan is refused with what to set, rather than silently stacking roles on GPU 0.

On Kubernetes neither is set: the device plugin gives each pod its GPUs, and the gpu
overlay requests ``learner.ranks`` of them for the learner and one slice per worker pod
(tests/test_deploy.py checks them against the overlay's run.yaml).

Only the planning runs here, on CPU (tests/test_gpus.py, with device counts given); that
vLLM and torch then open the devices they are shown is theirs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from launch.role_setup import parse_cpus
from rlpipe.config import ConfigError, RunConfig


def gpus_per_worker(cfg: RunConfig) -> int:
    from rollout_service.engine_args import engine_processes

    return engine_processes(cfg.rollout.engine)


@dataclass(frozen=True)
class GpuPlan:
    learner: tuple[int, ...] = ()
    workers: tuple[tuple[int, ...], ...] = ()  # worker i runs on workers[i % len(workers)]
    names: tuple[str, ...] = ()  # device i is names[i] in the children's CUDA_VISIBLE_DEVICES
    transport: str = ""  # sync.transport, resolved once for every role ("" = no GPUs: each resolves alone)

    def learner_env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": self._visible(self.learner), **self._transport()} if self.learner else {}

    def worker_env(self, index: int) -> dict[str, str]:
        """Worker ``index``'s devices; one added by ``rlpipe scale`` beyond the planned slices
        shares one (round robin), as a worker added beyond the cores shares a core."""
        if not self.workers:
            return {}
        return {"CUDA_VISIBLE_DEVICES": self._visible(self.workers[index % len(self.workers)]), **self._transport()}

    def _transport(self) -> dict[str, str]:
        return {"RLPIPE_SYNC__TRANSPORT": self.transport} if self.transport else {}

    def _visible(self, ids) -> str:
        return ",".join(self.names[i] if self.names else str(i) for i in ids)


def plan_gpus(cfg: RunConfig, n_devices: int, visible: str = "") -> GpuPlan:
    """The plan for a launcher that sees ``n_devices`` CUDA devices, ``visible`` being its own
    ``CUDA_VISIBLE_DEVICES`` (the ids are indices into it, as torch's are); ConfigError naming
    the key to change when ``rollout.gpus``/``learner.gpus`` cannot work there."""
    rollout, learner = parse_cpus(cfg.rollout.gpus), parse_cpus(cfg.learner.gpus)
    per = gpus_per_worker(cfg)
    ranks = cfg.learner.ranks
    for key, ids in (("rollout.gpus", rollout), ("learner.gpus", learner)):
        if ids and n_devices == 0:
            raise ConfigError(f"{key}: names GPUs {ids}, but this machine has no CUDA device")
        if missing := [i for i in ids if i >= n_devices]:
            raise ConfigError(f"{key}: GPUs {missing} do not exist here (devices 0-{n_devices - 1})")
    if n_devices == 0:
        _resolve(cfg.sync.transport, 0)  # a transport that needs CUDA, on a machine without: refused here
        return GpuPlan()
    if learner and len(learner) != ranks:
        raise ConfigError(f"learner.gpus: {len(learner)} GPUs for learner.ranks {ranks}: one GPU per rank")
    auto = not rollout and not learner
    if not learner:
        learner = list(range(ranks)) if auto else [i for i in range(n_devices) if i not in rollout][:ranks]
        if len(learner) < ranks:
            raise ConfigError(f"learner.gpus: learner.ranks {ranks} need {ranks} GPUs beside rollout.gpus, "
                              f"{len(learner)} left; set learner.gpus (it may share the workers' GPUs)")
    if not rollout:
        rollout = [i for i in range(n_devices) if i not in learner]
    slices = [tuple(rollout[k:k + per]) for k in range(0, len(rollout) - per + 1, per)]
    if len(slices) < cfg.worker_slots:
        hint = ("set rollout.gpus and learner.gpus (they may overlap) or run fewer workers" if auto else
                "name more GPUs or run fewer workers")
        raise ConfigError(f"rollout.gpus: {len(rollout)} GPUs ({rollout}) give {len(slices)} slice(s) of {per} "
                          f"for {cfg.worker_slots} workers; {hint}")
    names = tuple(v.strip() for v in visible.split(",")) if visible.strip() else ()
    return GpuPlan(tuple(learner), tuple(slices), names[:n_devices] if len(names) >= n_devices else (),
                   _resolve(cfg.sync.transport, n_devices, cfg.learner.lora.rank > 0,
                            (learner[0], slices[:cfg.worker_slots])))


def _resolve(requested: str, n_devices: int, adapters: bool = False, placement=None) -> str:
    """The transport every role of the run uses, decided once here (the children get it in
    their environment, so a learner and its workers never resolve ``auto`` apart).
    ``placement``: learner rank 0's GPU (it sends every update) and each worker's, which
    decide whom each transport reaches (weight_sync/transport_choice.py)."""
    from weight_sync.transport_choice import resolve_for_config  # torch, imported once a plan is made

    return resolve_for_config(requested, n_devices, adapters, placement)


def launch_plan(cfg: RunConfig) -> GpuPlan:
    """The plan for this machine, as ``rlpipe demo`` and ``rlpipe up`` launch."""
    from weight_sync.transport_choice import cuda_devices

    return plan_gpus(cfg, cuda_devices(), os.environ.get("CUDA_VISIBLE_DEVICES", ""))
