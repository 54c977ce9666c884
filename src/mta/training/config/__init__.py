"""A recipe, from file to validated object: everything `mta distill --recipe` reads before a model loads.

``yaml_reader`` (the one YAML reader) -> ``extends`` (``extends: PARENT`` chains) ->
``overrides`` (``key=value``) -> ``loading`` (``load_recipe``: the schema the recipe's task
picks, line-numbered errors) with ``schema`` (the shared base and the LLM recipe; the embedding
recipe lives in ``mta.embedding.recipe``). Beside them: ``catalog`` (the shipped recipes),
``deepspeed_settings`` (the ``deepspeed:`` passthrough), ``layers`` (layer maps),
``resume_rules`` (what a resume may change) and ``model_checks`` (the recipe against the models'
configs).
"""
