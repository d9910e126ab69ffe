"""Models whose constructor looks ``attn_implementation`` up in a table of their own, not transformers'
``AttentionInterface``: without an entry, loading one with ``"cascade"`` fails with a bare ``KeyError: 'cascade'``
(transformers 5.x). hf_cascade gives each table an entry that refuses clearly (:mod:`hf_cascade.attention`), as soon as
the module is loaded (:mod:`hf_cascade._registration`). Imports nothing.
"""

# (module, table, family)
OWN_ATTENTION_TABLES = (
    ("transformers.models.falcon.modeling_falcon", "FALCON_ATTENTION_CLASSES", "Falcon"),
    ("transformers.models.gpt_neo.modeling_gpt_neo", "GPT_NEO_ATTENTION_CLASSES", "GPT-Neo"),
)
