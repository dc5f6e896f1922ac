"""SHIM (tests only) for ``megatron/core/tokenizers/text/__init__.py`` (imports the tokenizer
back ends): the package over Megatron's own directory, so ``text.parsers`` is Megatron's."""
