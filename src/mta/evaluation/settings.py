"""What `mta evaluate` does; the defaults are the MiniLLM protocol (docs/method.md §6).

The protocol samples with top_k 0, top_p 1.0 and temperature 1.0; row ``index`` of set ``set``
under seed ``seed`` draws from ``sampling_seed(seed, "evaluate/<set>", 0, index)``, so its
sample does not depend on batching, ranks or resumption.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mta.data.prompts import Template
from mta.generation.sampling import SamplingParams, sampling_seed


def evaluation_seed(seed: int, set_name: str, index: int) -> int:
    """The random stream of row ``index`` of ``set_name`` under ``seed`` (step 0)."""
    return sampling_seed(seed, f"evaluate/{set_name}", 0, index)


class EvalSettings(BaseModel):
    """Sets, seeds, lengths, batching and precision of one evaluation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    benchmarks: list[str] | None = Field(None, description="None: every default set present")
    seeds: list[int] = Field(default_factory=lambda: [10, 20, 30, 40, 50], min_length=1)
    max_prompt_length: int = Field(256, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    batch_size: int = Field(16, ge=1)
    limit: int | None = Field(None, ge=1, description="first N rows of every set")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    device: str = "auto"
    perplexity: str | None = Field(None, description="set for teacher-forced perplexity, e.g. dolly-dev")
    perplexity_limit: int | None = Field(None, ge=1)
    perplexity_batch_size: int = Field(8, ge=1)
    template: Template = Field(
        "alpaca", description="how prompts are built (mta.data.prompts); chat: each checkpoint's own chat template"
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="the generation engine: hf (transformers, mta's own) or vllm (mta.generation.vllm_engine)"
    )
    split: str = Field("test", description="the split of a Hub dataset id in benchmarks")
    subset: str | None = Field(None, description="the subset (config name) of a Hub dataset id in benchmarks")
    revision: str | None = Field(None, description="the branch, tag or commit of a Hub dataset id in benchmarks")
    fields: dict[str, str] = Field(
        default_factory=dict, description="a Hub set's columns read as the row keys, {format key: column}"
    )

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be distinct")
        return seeds

    def sampling(self) -> SamplingParams:
        """The protocol's sampler: top_k 0, top_p 1.0, temperature 1.0, ``max_new_tokens``."""
        return SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=self.max_new_tokens)

    def sampling_description(self) -> str:
        """The sampler and its row key, as generation.json and results.json record them."""
        return f"{self.sampling().describe(self.engine)}; row key sampling_seed(seed, 'evaluate/<set>', 0, row index)"
