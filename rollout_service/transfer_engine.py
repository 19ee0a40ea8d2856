"""The binding of the nccl and ipc transports to vLLM: the engine's ``AsyncLLM`` as the
:class:`~weight_sync.device_updates.TransferEngine` that weight_sync/device_updates.py
drives (vLLM's own weight-transfer engines, which load what they receive into the
engine's model). Nothing here decides anything: every call is one of ``AsyncLLM``'s,
its request built from what weight_sync/ hands over.

GPU only: these calls need CUDA and have never run in this project; they are vLLM's,
which its authors test.
"""

from __future__ import annotations


class VllmTransferEngine:
    def __init__(self, llm):
        self.llm = llm  # the engine's AsyncLLM

    async def init(self, info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def start(self) -> None:
        await self.llm.start_weight_update()

    async def load(self, info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=info))

    async def finish(self, version: int) -> None:
        await self.llm.finish_weight_update(weight_version=str(version))

    async def shutdown(self) -> None:
        await self.llm.shutdown_weight_transfer_engine()
