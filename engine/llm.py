"""`EngineCore.generate`: vLLM's offline `LLM.generate` (vllm/entrypoints/llm.py) on the
core itself: prompts in, each request's final output out, in prompt order.

`LLMMixin` is mixed into EngineCore and drives it through its request API
(`add_request`, `step`, `abort_request`; the sleep level only for its error), on the
caller's thread, which must be the only one stepping the core.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from config import RequestOutputKind, SamplingParams
from engine.outputs import RequestOutput
from engine.processor import Prompt


class LLMMixin:
    """EngineCore's `generate`."""

    if TYPE_CHECKING:  # defined by EngineCore and SleepModeMixin
        _sleep_level: int | None

        def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> str: ...
        def abort_request(self, request_id: str) -> None: ...
        def step(self) -> list[RequestOutput]: ...

    def generate(
        self,
        prompts: Prompt | Iterable[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in prompt order.
        Only each request's final output is made (vLLM's LLM asks for FINAL_ONLY too),
        on copies: the caller's SamplingParams are left as they are. Raises ValueError
        for a refused prompt and RuntimeError while the engine sleeps; either way no
        request of the call is left running."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        final_only: dict[int, SamplingParams] = {}
        for sp in params:
            if id(sp) not in final_only:
                final_only[id(sp)] = copy.copy(sp)
                final_only[id(sp)].output_kind = RequestOutputKind.FINAL_ONLY
        params = [final_only[id(sp)] for sp in params]
        if self._sleep_level is not None:
            raise RuntimeError(f"the engine is sleeping (level {self._sleep_level}); call wake_up() first")
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for prompt, sp in zip(prompts, params):
                ids.append(self.add_request(prompt, sp))
            while len(final) < len(ids):
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            # A refused prompt or an interrupted loop must not leave the others running.
            for request_id in ids:
                if request_id not in final:
                    self.abort_request(request_id)
            raise
        return [final[i] for i in ids]
