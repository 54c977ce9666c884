"""The tasks ``mta distill`` trains, registered with the one training loop (``mta.task_registry``).

This module sits above ``mta.training`` and ``mta.embedding`` and is imported by the ``mta``
package itself, so every lookup finds both tasks registered. Each loader imports its task on
first use: looking up a recipe's schema never loads model code, and ``import mta`` stays light.
A new task is a ``Task`` in its own module and one ``register`` line here.
"""

from __future__ import annotations

from mta.task_registry import Task, register


def _llm() -> Task:
    from mta.training.llm.task import LLMTask

    return LLMTask()


def _embedding() -> Task:
    from mta.embedding.task import EmbeddingTask

    return EmbeddingTask()


register("llm", _llm)  # a recipe's default: distil a causal LM (mta.training.llm)
register("embedding", _embedding)  # TALAS: distil a sentence encoder (mta.embedding)
