"""coda.integrations: one-call adapters that make model libraries run on coda.

The top layer of the library (DESIGN.md section 2): it imports ``coda.nn`` and
``coda.fusions`` and nothing imports it. Each adapter lives in its own module and imports
its model library only when used, so none of them is a dependency of coda.

* ``coda.integrations.transformers``: ``apply_coda(model)`` patches a Hugging Face
  ``LlamaForCausalLM`` (or ``MistralForCausalLM`` / ``LlamaModel``) instance so its decoder
  stack runs through ``coda.nn.FusedLlamaStack`` and its training loss through
  ``coda.nn.LinearCrossEntropyLoss``, sharing the model's own parameters
  (docs/integrations.md).
"""

__all__: list[str] = []
